#!/usr/bin/env bash
# Session 20: run 16 = run 15's first 100 steps (run 14's recipe from run 14, seed 10), then the draft vocabulary
# chosen again on corpus v8 (refresh_draft_vocab: the shipped drafter's 8,192 ids were chosen on corpus v1 and
# cover 94.9% of v8's answer tokens and 92-95% of the target's answers to the evaluation prompts; v8's own top
# 8,192 cover 97.2% and 96.1%), trained on with a fresh schedule (peak lr 1.5e-4, seed 11).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
RUN=${RUN:-run16}; SEED=${SEED:-11}; STEPS=${STEPS:-360}; INIT=${INIT:-runs/run15/checkpoint-0000100}
mkdir -p runs
dspark train --config configs/smollm2-dspark-cached.yaml output_dir=runs/$RUN \
    init_from=$INIT refresh_draft_vocab=true feature_cache=null online_features=true seq_len=1024 \
    ce_first_steps=0 lr=1.5e-4 max_steps=$STEPS warmup_steps=20 save_every=25 eval_every=180 threads=2 seed=$SEED \
    split_seed=0 > runs/$RUN.out 2>&1
echo trained
