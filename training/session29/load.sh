#!/usr/bin/env bash
# Session 29: the load targets of #14 measured with more requests than slots (16 mt-bench prompts x 48 tokens: two
# waves at c = 8, four at c = 4, so a batch's drain is not the whole run), every static policy that can be best here
# (none, fixed-1/3/5) and the shipped dspark + gate, 3 alternated passes, compiled target and drafter, quiet machine.
# Argument: output name (default load_n16); N requests (default 16). Recompiles logged to NAME.err, the gate's rounds to
# NAME.trace.jsonl (python scripts/gate_trace.py NAME.trace.jsonl). DIR: where (default training/session29; session 30:
# DIR=training/session30, after attention split by segment size).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; NAME=${1:-load_n16}; N=${N:-16}; DIR=${DIR:-training/session29}; OUT=$DIR/$NAME
TORCH_LOGS=recompiles dspark bench load --max-concurrency 8 --num-requests "$N" --max-new-tokens 48 \
    --dataset $E/mt-bench.jsonl --policy none --policy fixed-1 --policy fixed-3 --policy fixed-5 --policy dspark \
    --repeats 3 --compile --gate-trace $OUT.trace.jsonl --json > $OUT.json 2> $OUT.err
