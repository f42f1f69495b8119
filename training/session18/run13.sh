#!/usr/bin/env bash
# Session 18: run 13 = run 10's recipe (training/session14/run10.sh) for 600 more steps from run 12 (session 17, not
# shipped; its weights in runs/run12/final on the machine that trained it) on corpus v8, with a new data order, then
# calibration and the 10-prompt evaluation at T = 0 and T = 1 (seeds 0 and 1). One change: peak lr 1.5e-4 instead of
# 3e-4 (runs 9-12 each lost held-out tau in their first half, e.g. run 12 2.461 -> 2.417 at step 300, and gained it
# back only as the cosine decayed: a continuation from an annealed drafter re-warmed too far).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; RUN=run13; INIT=${INIT:-runs/run12/final}
dspark train --config configs/smollm2-dspark-cached.yaml output_dir=runs/$RUN \
    init_from=$INIT feature_cache=null online_features=true seq_len=1024 \
    ce_first_steps=0 lr=1.5e-4 max_steps=600 warmup_steps=30 save_every=50 eval_every=300 threads=2 seed=8 split_seed=0 \
    > runs/$RUN.out 2>&1
mkdir -p training/$RUN
training/post_run.sh runs/$RUN training/$RUN > training/$RUN/post_run.out 2>&1
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
for T in 0 1; do
  dspark eval --drafter training/$RUN/drafter "${EVAL[@]}" --temperature $T > training/$RUN/eval10_T${T}_$RUN.json \
      2> training/$RUN/eval10_T${T}_$RUN.err
done
dspark eval --drafter training/$RUN/drafter "${EVAL[@]}" --temperature 1 --seed 1 \
    > training/$RUN/eval10_T1_seed1_$RUN.json 2> training/$RUN/eval10_T1_seed1_$RUN.err
echo done
