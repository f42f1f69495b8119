#!/usr/bin/env bash
# Session 27: session 26's compiled load run (--compile) now that the DSpark drafter's round is compiled too.
# Arguments: output name (default load_compile), number of requests (default 8; more than the concurrency keeps
# the slots refilled, as a server's queue does). Recompiles logged to NAME.err.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; NAME=${1:-load_compile}; N=${2:-8}; OUT=training/session27/$NAME
TORCH_LOGS=recompiles dspark bench load --max-concurrency 8 --num-requests "$N" --max-new-tokens 48 \
    --dataset $E/mt-bench.jsonl --policy none --policy fixed-1 --policy fixed-3 --policy fixed-5 --policy dspark \
    --policy dspark:no-gate --policy dspark-async --repeats 3 --compile --json > $OUT.json 2> $OUT.err
