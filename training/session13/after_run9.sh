#!/usr/bin/env bash
# Session 13, after run 9 finished (quiet machine, one job at a time): calibrate + evaluate run 9 as it would ship,
# evaluate the shipped run 8 on the same 10 prompts a domain with the same code, then the speed benchmarks.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
S=training/session13; E=../shared/eval_datasets
training/post_run.sh runs/run9 training/run9 > training/run9/post_run.out 2>&1
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
for T in 0 1; do
  for pair in run9:training/run9/drafter run8:dspark/checkpoints/smollm2-135m-dspark; do
    dspark eval --drafter "${pair#*:}" "${EVAL[@]}" --temperature $T > training/run9/eval10_T${T}_${pair%%:*}.json \
        2> training/run9/eval10_T${T}_${pair%%:*}.err
  done
done
python scripts/ab_forward.py --old-rev dd92dec --tokens 1 8 --repeats 31 > $S/ab_forward.json 2> $S/ab_forward.err
dspark bench forward --repeats 15 > $S/forward_bf16.json 2> $S/forward_bf16.err
# (ran without the drafters' rows; training/session13/speed.sh, run after this script, has them)
dspark bench speed --dataset $E/humaneval.jsonl --num-prompts 4 --max-new-tokens 128 --scheduler dspark \
    --peer llama.cpp --peer-gguf bf16 --json > $S/speed_bf16_nodrafter.json 2> $S/speed_bf16_nodrafter.err

dspark bench load --max-concurrency 8 --num-requests 8 --max-new-tokens 48 --dataset $E/mt-bench.jsonl \
    --policy none --policy fixed-3 --policy fixed-7 --policy dspark --policy dspark-async --repeats 3 \
    --json > $S/load_bf16.json 2> $S/load_bf16.err
echo done
