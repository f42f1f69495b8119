#!/usr/bin/env bash
# Session 26: load.sh's run with --compile (single requests and rounds of several requests compiled, every graph
# compiled before the first timed pass); recompiles logged to NAME.err. Argument: output name (default load_compile).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; NAME=${1:-load_compile}; OUT=training/session26/$NAME
TORCH_LOGS=recompiles dspark bench load --max-concurrency 8 --num-requests 8 --max-new-tokens 48 \
    --dataset $E/mt-bench.jsonl --policy none --policy fixed-1 --policy fixed-3 --policy fixed-5 --policy dspark \
    --policy dspark:no-gate --policy dspark-async --repeats 3 --compile --json > $OUT.json 2> $OUT.err
