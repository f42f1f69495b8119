#!/usr/bin/env bash
# Session 16: run 11 = run 10's recipe (training/session14/run10.sh: 600 more steps from the shipped drafter, then
# calibration and the 10-prompt evaluation) with a new data order, on corpus v7 (committed this session).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=run11 SEED=6 bash training/session14/run10.sh
