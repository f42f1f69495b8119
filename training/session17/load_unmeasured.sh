#!/usr/bin/env bash
# Session 17: where dspark's time goes at c = 1-4 beside no speculation, with every gated round traced, measured or
# not (prefill, catch-up, lookup drafts only): mt-bench 8 x 48, median of 3 passes; training/session17/load_unmeasured.*
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=training/session17/load_unmeasured
dspark bench load --max-concurrency 4 --num-requests 8 --max-new-tokens 48 --dataset $E/mt-bench.jsonl \
    --policy none --policy dspark --policy dspark:no-gate --repeats 3 --json --gate-trace ${OUT}_trace.jsonl \
    > $OUT.json 2> $OUT.err
