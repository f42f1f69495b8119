#!/usr/bin/env bash
# Session 17: the soup of run 11 (shipped) and run 12 (600 steps more from it): training/session17/soup.py, then
# calibration and the same evaluation as run 12 (training/session14/run10.sh's 10 prompts a domain, T = 0 and 1, and
# T = 1 with seed 1), written to training/soup12/.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=training/soup12
python training/session17/soup.py dspark/checkpoints/smollm2-135m-dspark runs/run12/final runs/soup12 runs/run12
mkdir -p $OUT
training/post_run.sh runs/soup12 $OUT > $OUT/post_run.out 2>&1
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
for T in 0 1; do
  dspark eval --drafter $OUT/drafter "${EVAL[@]}" --temperature $T > $OUT/eval10_T${T}_soup12.json 2> $OUT/eval10_T${T}_soup12.err
done
dspark eval --drafter $OUT/drafter "${EVAL[@]}" --temperature 1 --seed 1 > $OUT/eval10_T1_seed1_soup12.json \
    2> $OUT/eval10_T1_seed1_soup12.err
echo done
