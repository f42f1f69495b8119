#!/usr/bin/env bash
# Session 13: the speed table with the shipped drafter (run 9), quiet machine, after after_run9.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets
dspark bench speed --dataset $E/humaneval.jsonl --num-prompts 4 --max-new-tokens 128 --scheduler dspark \
    --drafter dspark=default --drafter lookup=default+ngram --peer llama.cpp --peer-gguf bf16 --json \
    > training/session13/speed_bf16.json 2> training/session13/speed_bf16.err
