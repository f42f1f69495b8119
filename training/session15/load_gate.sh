#!/usr/bin/env bash
# Session 15: bench load with the draft gate (dspark, dspark-async: default on) beside the same schedulers without
# it and every static policy, quiet machine, median of 3 passes.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets
dspark bench load --max-concurrency 8 --num-requests 8 --max-new-tokens 48 --dataset $E/mt-bench.jsonl \
    --policy none --policy fixed-1 --policy fixed-3 --policy fixed-5 --policy fixed-7 --policy dspark \
    --policy dspark:no-gate --policy dspark-async --policy dspark-async:no-gate --repeats 3 --json \
    > training/session15/load_gate.json 2> training/session15/load_gate.err
