#!/usr/bin/env bash
# Session 19, after run 14 trained: calibration and the 4-prompt evaluation (post_run.sh), the 10-prompt evaluation of
# run 14 and run 11 (shipped) in this machine's float32 (T = 0: the same greedy text, paired; T = 1 seeds 0 and 1
# for run 14), the paired teacher-forced scores of both on the target's answers to 40 prompts a set (paired.sh), and
# the train/serve check: the chained teacher-forced tau on the target's greedy answers to the 10-prompt evaluation's
# own prompts and length (96 tokens) against the rollout tau of eval10_T0.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=training/run14
mkdir -p $OUT
training/post_run.sh runs/run14 $OUT > $OUT/post_run.out 2>&1
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
dspark eval --drafter $OUT/drafter "${EVAL[@]}" --temperature 0 > $OUT/eval10_T0_run14.json 2> $OUT/eval10_T0_run14.err
dspark eval "${EVAL[@]}" --temperature 0 > $OUT/eval10_T0_run11_fp32.json 2> $OUT/eval10_T0_run11_fp32.err
bash training/session19/paired.sh $OUT/paired $OUT/drafter dspark/checkpoints/smollm2-135m-dspark > $OUT/paired.out 2>&1
WORK=/tmp/dspark_paired10 N=10 TOKENS=96 bash training/session19/paired.sh $OUT/paired10 $OUT/drafter \
    dspark/checkpoints/smollm2-135m-dspark > $OUT/paired10.out 2>&1
for SEED in 0 1; do
  dspark eval --drafter $OUT/drafter "${EVAL[@]}" --temperature 1 --seed $SEED > $OUT/eval10_T1_seed${SEED}_run14.json \
      2> $OUT/eval10_T1_seed${SEED}_run14.err
done
echo done
