#!/usr/bin/env bash
# Session 16: session 15's batch-1 speed run (training/session15/speed_gate.sh: 4 humaneval prompts x 128 tokens,
# bf16, beside HF generate and llama.cpp) with the run 11 drafter and the gate's neighbour sharing, quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets
dspark bench speed --dataset $E/humaneval.jsonl --num-prompts 4 --max-new-tokens 128 \
    --drafter dspark=default --drafter lookup=default+ngram --scheduler dspark \
    --peer llama.cpp --peer-gguf bf16 --peer-threads 1 --peer-threads 2 --json \
    > training/session16/speed.json 2> training/session16/speed.err
