#!/usr/bin/env bash
# Session 15: batch-1 greedy speed on code prompts with the draft gate (default on for dspark), beside llama.cpp
# (bf16 GGUF: the wheel's Q4_1 kernels need AVX-VNNI, which Zen 4 lacks), quiet machine.
# Argument: the output path without extension (default training/session15/speed_bf16).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=${1:-training/session15/speed_bf16}
dspark bench speed --dataset $E/humaneval.jsonl --num-prompts 4 --max-new-tokens 128 \
    --drafter dspark=default --drafter lookup=default+ngram --scheduler dspark \
    --peer llama.cpp --peer-gguf bf16 --peer-threads 1 --peer-threads 2 --json \
    > $OUT.json 2> $OUT.err
