#!/usr/bin/env bash
# Session 23: batch-1 greedy speed on code prompts, eager and compiled (`--compile`: dspark.compiled) side by side,
# beside HF and llama.cpp (bf16 GGUF), on a quiet 2-core Zen 4 (AVX512-BF16); training/session23/speed_compile.*
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=training/session23/speed_compile
dspark bench speed --dataset $E/humaneval.jsonl --num-prompts 4 --max-new-tokens 128 \
    --drafter dspark=default --drafter lookup=default+ngram --scheduler dspark --compile \
    --peer llama.cpp --peer-gguf bf16 --peer-threads 1 --peer-threads 2 --json \
    > $OUT.json 2> $OUT.err
