#!/usr/bin/env bash
# Session 24: session 23's compiled speed run (no llama.cpp rows) after the dspark scheduler of a compiled engine
# reads step rates measured through the compiled forward (profile cached apart, "-compiled");
# training/session24/speed_compile.*
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=training/session24/speed_compile
dspark bench speed --dataset $E/humaneval.jsonl --num-prompts 4 --max-new-tokens 128 \
    --drafter dspark=default --drafter lookup=default+ngram --scheduler dspark --compile --json \
    > $OUT.json 2> $OUT.err
