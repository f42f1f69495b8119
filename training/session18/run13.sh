#!/usr/bin/env bash
# Session 18: run 13 = run 10's recipe (training/session14/run10.sh) for 600 more steps from run 12 (session 17, not
# shipped; its weights in runs/run12/final on the machine that trained it) on corpus v8, with a new data order, then
# calibration and the 10-prompt evaluation at T = 0 and T = 1 (seeds 0 and 1). One change: peak lr 1.5e-4 instead of
# 3e-4 (runs 9-12 each lost held-out tau in their first half, e.g. run 12 2.461 -> 2.417 at step 300, and gained it
# back only as the cosine decayed: a continuation from an annealed drafter re-warmed too far).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=run13 SEED=8 INIT=${INIT:-runs/run12/final} LR=1.5e-4 bash training/session14/run10.sh
. .venv/bin/activate
E=../shared/eval_datasets
dspark eval --drafter training/run13/drafter --dataset $E/math500.jsonl --dataset $E/humaneval.jsonl \
    --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl --num-prompts 10 --max-new-tokens 96 --json --temperature 1 \
    --seed 1 > training/run13/eval10_T1_seed1_run13.json 2> training/run13/eval10_T1_seed1_run13.err
