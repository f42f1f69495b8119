#!/usr/bin/env bash
# After a run beat the shipped drafter on eval10 at T = 0 (eval_pair.sh): calibration and the 4-prompt evaluation
# (post_run.sh, this machine's dtype) into training/RUN, the T = 0 calibration again on 80 prompts (as run 16 shipped),
# the 10-prompt evaluation at T = 0 of the calibrated copy (expected tau), and at T = 1 (seeds 0 and 1) of the run
# and of the shipped drafter through the same code, into EV. Quiet machine. Session 29: RUN=run20
# EV=training/session29/eval; session 30: RUN=run21 EV=training/session30/eval.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
E=../shared/eval_datasets; RUN=${RUN:?RUN=runNN}; OUT=training/$RUN; EV=${EV:?EV=training/sessionNN/eval}
mkdir -p $OUT $EV
training/post_run.sh runs/$RUN $OUT > $OUT/post_run.out 2>&1
dspark calibrate --drafter $OUT/drafter --corpus corpora/smollm2-135m-instruct.safetensors --num-prompts 80 \
    --corpus-source code-task --corpus-source sharegpt --max-new-tokens 128 --temperature 0 --json \
    > $OUT/calibrate_T0_80prompts.json 2> $OUT/calibrate_T0_80prompts.err
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
dspark eval --drafter $OUT/drafter "${EVAL[@]}" --temperature 0 > $OUT/eval10_T0_${RUN}_cal80.json \
    2> $OUT/eval10_T0_${RUN}_cal80.err
for SEED in 0 1; do
  for PAIR in shipped:dspark/checkpoints/smollm2-135m-dspark $RUN:$OUT/drafter; do
    NAME=${PAIR%%:*}; DRAFTER=${PAIR#*:}
    dspark eval --drafter $DRAFTER "${EVAL[@]}" --temperature 1 --seed $SEED > $EV/eval10_T1_seed${SEED}_$NAME.json \
        2> $EV/eval10_T1_seed${SEED}_$NAME.err
  done
done
echo done
