#!/usr/bin/env bash
# Session 35: the shipping comparison. eval10 (10 prompts a domain) moves ~1% between drafters that differ by less,
# so candidates are compared with the shipped drafter on the target's own answers to the first 40 prompts of each
# evaluation set (128 tokens, this machine's dtype, greedy and T = 1; answers made once and cached in $WORK), scored
# teacher-forced in rollout order (exactly what a T = 0 rollout along that text accepts), with a paired bootstrap
# over the 160 prompts: ratio, 95% interval, P(candidate ahead), overall and per set. Quiet machine not needed (no
# timing). ~2 min of answers per temperature once, then ~1.5 min per drafter and temperature on 2 cores.
#   OUT=training/session35/paired bash training/paired_vs_shipped.sh runs/run26/final [more drafters]
# The shipped drafter's score is cached in OUT by its directory's name: after shipping, use a new OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=${OUT:?OUT=training/sessionNN/paired}; export WORK=${WORK:-/tmp/dspark_paired_bf16} DTYPE=${DTYPE:-auto} TEMPS="0 1"
SHIPPED=dspark/checkpoints/smollm2-135m-dspark
todo=()
for DRAFTER in $SHIPPED "$@"; do  # a drafter already scored with per-sample sums is not scored again
  NAME=$(basename "$(dirname "$DRAFTER")")_$(basename "$DRAFTER")
  grep -qs '"samples"' "$OUT/paired_T1_$NAME.json" || todo+=("$DRAFTER")
done
[ ${#todo[@]} -eq 0 ] || bash training/session19/paired.sh "$OUT" "${todo[@]}"
for DRAFTER in "$@"; do
  NAME=$(basename "$(dirname "$DRAFTER")")_$(basename "$DRAFTER")
  for T in 0 1; do
    echo "== $DRAFTER vs shipped, T = $T"
    python -m dspark.eval.paired "$OUT/paired_T${T}_checkpoints_smollm2-135m-dspark.json" "$OUT/paired_T${T}_$NAME.json" \
        --temperature $T > "$OUT/bootstrap_T${T}_$NAME.json"
  done
done
