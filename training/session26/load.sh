#!/usr/bin/env bash
# Session 26: session 18's load run (8 mt-bench prompts x 48 tokens, c = 1..8, median of 3 passes, bf16, default
# drafter) again with the run-16 drafter, which no load run had measured. Argument: output name under
# training/session26/ (default load); writes NAME.json, NAME.err and NAME_trace.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; NAME=${1:-load}; OUT=training/session26/$NAME
dspark bench load --max-concurrency 8 --num-requests 8 --max-new-tokens 48 --dataset $E/mt-bench.jsonl \
    --policy none --policy fixed-1 --policy fixed-3 --policy fixed-5 --policy dspark --policy dspark:no-gate \
    --policy dspark-async --repeats 3 --json --gate-trace ${OUT}_trace.jsonl > $OUT.json 2> $OUT.err
