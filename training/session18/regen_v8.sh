#!/usr/bin/env bash
# Session 18: corpus v8 = v7 + the last 1,201 prompts of data/prompts_all.jsonl v7 left unanswered (the longest).
# data/prompts_v7.jsonl is session 16's list (prompts_all minus v6's ids, shuffled with seed 0, sorted by length);
# regenerate appends to data/regen_v7.jsonl and skips the ids already answered there and in the committed corpus
# (session 18 stopped it at 3,072 of 3,313 and ran the pack line by hand; rerunning the script continues the last 241).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
dspark data regenerate --prompts data/prompts_v7.jsonl --out data/regen_v7.jsonl --batch-size 64 \
    --threads 2 --dtype bfloat16 --max-new-tokens 256 --skip corpora/smollm2-135m-instruct.safetensors
dspark data pack --jsonl data/regen_v7.jsonl --corpus corpora/smollm2-135m-instruct.safetensors \
    --out corpora/smollm2-135m-instruct.safetensors
