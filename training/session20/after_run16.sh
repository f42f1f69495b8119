#!/usr/bin/env bash
# Session 20, after run 16 trained: calibration and the 4-prompt evaluation (post_run.sh), the 10-prompt evaluation in
# this machine's float32 at T = 0 (the same greedy text as run 14's in training/run14/eval10_T0_run14.json, paired) and
# T = 1 (seeds 0 and 1), and the paired teacher-forced scores on the target's answers to 40 prompts a set
# (paired.sh; run 14's are in training/run14/paired, scored on the same answers on this machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; RUN=${RUN:-run16}; OUT=training/$RUN
mkdir -p $OUT
training/post_run.sh runs/$RUN $OUT > $OUT/post_run.out 2>&1
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
dspark eval --drafter $OUT/drafter "${EVAL[@]}" --temperature 0 > $OUT/eval10_T0_$RUN.json 2> $OUT/eval10_T0_$RUN.err
bash training/session19/paired.sh $OUT/paired $OUT/drafter > $OUT/paired.out 2>&1
for SEED in 0 1; do
  dspark eval --drafter $OUT/drafter "${EVAL[@]}" --temperature 1 --seed $SEED > $OUT/eval10_T1_seed${SEED}_$RUN.json \
      2> $OUT/eval10_T1_seed${SEED}_$RUN.err
done
# The 40-prompt T = 0 calibration above predicted 6.0% over the eval10 rollouts (the noise of 1,954 rounds: its
# position-2 bias moved from +0.09 to -0.04 with more); calibrated again on 80 prompts (4,365 rounds), as shipped:
dspark calibrate --drafter $OUT/drafter --corpus corpora/smollm2-135m-instruct.safetensors --num-prompts 80 \
    --corpus-source code-task --corpus-source sharegpt --max-new-tokens 128 --temperature 0 --json \
    > $OUT/calibrate_T0_80prompts.json 2> $OUT/calibrate_T0_80prompts.err
dspark eval --drafter $OUT/drafter "${EVAL[@]}" --temperature 0 > $OUT/eval10_T0_${RUN}_cal80.json \
    2> $OUT/eval10_T0_${RUN}_cal80.err
echo done
