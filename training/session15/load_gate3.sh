#!/usr/bin/env bash
# Session 15, final gate (expected tokens, 10% margin): dspark with and without it beside the static policies that
# were best at some level in load_gate2 (none, fixed-1, fixed-3, fixed-5), quiet machine, median of 3 passes.
# Arguments: the output name under training/session15/ (default load_gate3; load_gate4.sh reruns it as load_gate4), then
# extra options for dspark bench load (session 17: --gate-trace).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=training/session15/${1:-load_gate3}
dspark bench load --max-concurrency 8 --num-requests 8 --max-new-tokens 48 --dataset $E/mt-bench.jsonl \
    --policy none --policy fixed-1 --policy fixed-3 --policy fixed-5 --policy dspark --policy dspark:no-gate \
    --policy dspark-async --repeats 3 --json "${@:2}" > $OUT.json 2> $OUT.err
