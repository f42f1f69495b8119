#!/usr/bin/env bash
# Session 21, after both arms of the depth A/B trained (run 17: 2 layers, run 18: LAYERS=3, grown; both 250 steps
# from run 16, seed 12): the 10-prompt evaluation at T = 0 in this machine's float32 (tau per domain and the draft /
# verify ms per round), then the paired teacher-forced scores of run 16 (shipped), run 17 and run 18 on the target's
# answers to 40 prompts a set (paired.sh). Run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=training/session21/ab
bash training/eval10.sh $OUT runs/run17 runs/run18
bash training/session19/paired.sh $OUT/paired dspark/checkpoints/smollm2-135m-dspark runs/run17/final runs/run18/final \
    > $OUT/paired.out 2>&1
tail -6 $OUT/paired.out
echo done
