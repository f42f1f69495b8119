#!/usr/bin/env bash
# Session 21, the depth A/B's second arm: run 18 = run 17 (training/session19/run14.sh from the shipped run 16, seed
# 12, 250 steps at peak lr 1.5e-4 on corpus v8) with a third draft layer grown on top (`num_draft_layers=3` from the
# 2-layer checkpoint: a copy of the trained top layer with o_proj and down_proj at zero, so step 0 computes exactly
# run 16's blocks). Same seed, data order, schedule and budget as run 17.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
RUN=${RUN:-run18}; SEED=${SEED:-12}; STEPS=${STEPS:-250}; LAYERS=${LAYERS:-3}
INIT=${INIT:-dspark/checkpoints/smollm2-135m-dspark}
mkdir -p runs
dspark train --config configs/smollm2-dspark-cached.yaml output_dir=runs/$RUN \
    init_from=$INIT num_draft_layers=$LAYERS feature_cache=null online_features=true seq_len=1024 \
    ce_first_steps=0 lr=1.5e-4 max_steps=$STEPS warmup_steps=20 save_every=25 eval_every=200 threads=2 seed=$SEED \
    split_seed=0 > runs/$RUN.out 2>&1
echo trained
