#!/usr/bin/env bash
# Session 14, final code: bench load with dspark-planned beside every other policy, quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets
dspark bench load --max-concurrency 8 --num-requests 8 --max-new-tokens 48 --dataset $E/mt-bench.jsonl \
    --policy none --policy fixed-1 --policy fixed-3 --policy fixed-5 --policy fixed-7 --policy dspark \
    --policy dspark-planned --policy dspark-async --repeats 3 --json \
    > training/session14/load_bf16_planned.json 2> training/session14/load_bf16_planned.err
