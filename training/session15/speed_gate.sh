#!/usr/bin/env bash
# Session 15: batch-1 greedy speed on code prompts with the draft gate (default on for dspark), beside llama.cpp
# (bf16 GGUF: the wheel's Q4_1 kernels need AVX-VNNI, which Zen 4 lacks), quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets
dspark bench speed --dataset $E/humaneval.jsonl --num-prompts 4 --max-new-tokens 128 \
    --drafter dspark=default --drafter lookup=default+ngram --scheduler dspark \
    --peer llama.cpp --peer-gguf bf16 --peer-threads 1 --peer-threads 2 --json \
    > training/session15/speed_bf16.json 2> training/session15/speed_bf16.err
