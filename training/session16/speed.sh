#!/usr/bin/env bash
# Session 16: session 15's batch-1 speed run (4 humaneval prompts x 128 tokens, bf16, beside HF generate and
# llama.cpp) with the run 11 drafter and the gate's neighbour sharing, quiet machine; written as training/session16/speed.*
set -euo pipefail
cd "$(dirname "$0")/../.."
bash training/session15/speed_gate.sh training/session16/speed
