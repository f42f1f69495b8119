#!/usr/bin/env bash
# Session 14: run 10 = 600 more steps from run 9 (the shipped drafter), run 9's recipe with a new data order,
# then calibration and evaluation on the same 10 prompts a domain as run 9 (training/run9/eval10_*).
# RUN=name SEED=n: another run of the same recipe from the shipped drafter (session 16: RUN=run11 SEED=6);
# INIT=checkpoint and LR=peak: from another drafter, at another peak learning rate (session 18's run 13).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; RUN=${RUN:-run10}; SEED=${SEED:-5}
INIT=${INIT:-dspark/checkpoints/smollm2-135m-dspark}; LR=${LR:-3e-4}
dspark train --config configs/smollm2-dspark-cached.yaml output_dir=runs/$RUN \
    init_from=$INIT feature_cache=null online_features=true seq_len=1024 \
    ce_first_steps=0 lr=$LR max_steps=600 warmup_steps=30 save_every=50 eval_every=300 threads=2 seed=$SEED split_seed=0 \
    > runs/$RUN.out 2>&1
mkdir -p training/$RUN
training/post_run.sh runs/$RUN training/$RUN > training/$RUN/post_run.out 2>&1
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
for T in 0 1; do
  dspark eval --drafter training/$RUN/drafter "${EVAL[@]}" --temperature $T > training/$RUN/eval10_T${T}_$RUN.json \
      2> training/$RUN/eval10_T${T}_$RUN.err
done
echo done
