#!/usr/bin/env bash
# Session 14: bench load after the interleaved SPS profile (v2 profile file), quiet machine, every fixed gamma.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets
S=training/session14
dspark bench load --max-concurrency 8 --num-requests 8 --max-new-tokens 48 --dataset $E/mt-bench.jsonl \
    --policy none --policy fixed-1 --policy fixed-3 --policy fixed-5 --policy fixed-7 --policy dspark \
    --policy dspark-async --repeats 3 --json > $S/load_bf16${TAG:-}.json 2> $S/load_bf16${TAG:-}.err
