#!/usr/bin/env bash
# Session 20 (the same AVX2-only machine as session 19: float32 target and training): run 15 continues from run 14
# (shipped) with run 14's recipe (corpus v8, peak lr 1.5e-4) and a new data order (seed 10).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=${RUN:-run15} SEED=${SEED:-10} STEPS=${STEPS:-450} bash training/session19/run14.sh
