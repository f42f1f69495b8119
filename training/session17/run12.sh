#!/usr/bin/env bash
# Session 17: run 12 = run 10's recipe (training/session14/run10.sh: 600 more steps from the shipped drafter, run 11,
# then calibration and the 10-prompt evaluation) with a new data order, on corpus v7.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=run12 SEED=7 bash training/session14/run10.sh
