#!/usr/bin/env bash
# What a drafter costs per round, side by side: `dspark eval` at T = 0 on 2 humaneval prompts x 96 tokens in the target's
# auto dtype, each drafter in turn, the whole sequence twice (alternated, so drift hits every drafter alike); draft and
# verify ms per round, tau and rounds (drafters that must draft the same text show equal tau). Run on a quiet machine.
#   bash training/draft_cost.sh OUT_DIR DRAFTER...     (OUT_DIR/<drafter dir name>_pass<1|2>.json)
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=$1; shift; mkdir -p "$OUT"
for PASS in 1 2; do
  for DRAFTER in "$@"; do
    NAME=$(basename "$DRAFTER")
    dspark eval --drafter "$DRAFTER" --dataset $E/humaneval.jsonl --num-prompts 2 --max-new-tokens 96 \
        --temperature 0 --json > "$OUT/${NAME}_pass$PASS.json" 2> "$OUT/${NAME}_pass$PASS.err"
  done
done
python - "$OUT" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(path.read_text().splitlines()[-1])
    print(path.stem, {k: d.get(k) for k in ("tau", "num_rounds", "draft_ms_per_round", "verify_ms_per_round", "tokens_per_s")})
PY
