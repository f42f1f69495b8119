#!/usr/bin/env bash
# Session 19 (an AVX2-only machine: float32 target and training): run 14 = run 13's recipe (peak lr 1.5e-4, corpus
# v8, new data order) from run 11, the shipped drafter, since run 12/13's weights stayed on the machine that trained
# them. STEPS (default 400) fits the session's CPU budget; then calibration and the 10-prompt evaluation.
# LAYERS (default 2) above the checkpoint's grows the drafter (session 21's depth A/B: LAYERS=3 RUN=run18 SEED=12 STEPS=250).
# Further KEY=VALUE arguments override the config too (session 22's loss A/B: ce_weight=0.5 tv_weight=0.5).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; RUN=${RUN:-run14}; SEED=${SEED:-9}; STEPS=${STEPS:-400}
INIT=${INIT:-dspark/checkpoints/smollm2-135m-dspark}; LAYERS=${LAYERS:-2}
mkdir -p runs
dspark train --config configs/smollm2-dspark-cached.yaml output_dir=runs/$RUN \
    init_from=$INIT num_draft_layers=$LAYERS feature_cache=null online_features=true seq_len=1024 \
    ce_first_steps=0 lr=1.5e-4 max_steps=$STEPS warmup_steps=20 save_every=25 eval_every=200 threads=2 seed=$SEED \
    split_seed=0 "$@" > runs/$RUN.out 2>&1
echo trained
