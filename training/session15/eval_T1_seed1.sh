#!/usr/bin/env bash
# Session 15: run 9 (shipped) and run 10 on the 10-prompt evaluation at T = 1 with another seed: sampled rollouts of
# two drafters part from the first differing round, so one seed's T = 1 comparison is noisy.
set -uo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
while pgrep -f "session15/probe_compile.sh" > /dev/null; do sleep 20; done
E=../shared/eval_datasets
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json --temperature 1 --seed 1)
dspark eval --drafter dspark/checkpoints/smollm2-135m-dspark "${EVAL[@]}" > training/run10/eval10_T1_seed1_run9.json \
    2> training/run10/eval10_T1_seed1_run9.err
dspark eval --drafter training/run10/drafter "${EVAL[@]}" > training/run10/eval10_T1_seed1_run10.json \
    2> training/run10/eval10_T1_seed1_run10.err
echo done
