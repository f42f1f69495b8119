#!/usr/bin/env bash
# Session 16: corpus v7 (v6 + the prompts_all prompts answered this session), then run 11 = 600 more steps from
# run 10 (the shipped drafter) on it, run 10's recipe with a new data order, then calibration and evaluation on the
# same 10 prompts a domain as runs 9 and 10 (training/run10/eval10_*).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets
dspark train --config configs/smollm2-dspark-cached.yaml output_dir=runs/run11 \
    init_from=dspark/checkpoints/smollm2-135m-dspark feature_cache=null online_features=true seq_len=1024 \
    ce_first_steps=0 lr=3e-4 max_steps=600 warmup_steps=30 save_every=50 eval_every=300 threads=2 seed=6 split_seed=0 \
    > runs/run11.out 2>&1
mkdir -p training/run11
training/post_run.sh runs/run11 training/run11 > training/run11/post_run.out 2>&1
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
for T in 0 1; do
  dspark eval --drafter training/run11/drafter "${EVAL[@]}" --temperature $T > training/run11/eval10_T${T}_run11.json \
      2> training/run11/eval10_T${T}_run11.err
done
echo done
