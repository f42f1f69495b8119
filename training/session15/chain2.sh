#!/usr/bin/env bash
# Session 15, after the runtime benchmarks: the compile probe, run 9 / run 10 at T = 1 with another seed, then bench
# load again with the gate's catch-up fix (commit after c61f07a), all on the quiet machine, one after another.
set -uo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
while pgrep -f "session15/after_run10.sh" > /dev/null; do sleep 15; done
python scripts/probe_compile.py --tokens 1 8 --repeats 21 --plain-weights --freezing \
    > training/session15/probe_compile_freezing.json 2> training/session15/probe_compile_freezing.err
echo "probe rc=$?"
E=../shared/eval_datasets
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json --temperature 1 --seed 1)
dspark eval --drafter dspark/checkpoints/smollm2-135m-dspark "${EVAL[@]}" > training/run10/eval10_T1_seed1_run9.json \
    2> training/run10/eval10_T1_seed1_run9.err
dspark eval --drafter training/run10/drafter "${EVAL[@]}" > training/run10/eval10_T1_seed1_run10.json \
    2> training/run10/eval10_T1_seed1_run10.err
echo "eval done"
dspark bench load --max-concurrency 8 --num-requests 8 --max-new-tokens 48 --dataset $E/mt-bench.jsonl \
    --policy none --policy fixed-1 --policy fixed-3 --policy fixed-5 --policy fixed-7 --policy dspark \
    --policy dspark:no-gate --policy dspark-async --policy dspark-async:no-gate --repeats 3 --json \
    > training/session15/load_gate2.json 2> training/session15/load_gate2.err
echo "load rc=$?"
