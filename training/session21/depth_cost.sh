#!/usr/bin/env bash
# Session 21: what a third draft layer costs per round. The shipped drafter saved with 2 and with 3 draft layers (the
# third grown, adding nothing: grow_untrained.py), `dspark eval` at T = 0 on 2 humaneval prompts x 96 tokens, float32
# (this AVX2 CPU's auto), alternated twice on a quiet machine; tau must be equal, draft ms per round is the cost.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=${OUT:-training/session21/depth_cost}; mkdir -p $OUT
python training/session21/grow_untrained.py /tmp/grow
for PASS in 1 2; do
  for L in 2 3; do
    dspark eval --drafter /tmp/grow/layers$L --dataset $E/humaneval.jsonl --num-prompts 2 --max-new-tokens 96 \
        --temperature 0 --json > $OUT/layers${L}_pass$PASS.json 2> $OUT/layers${L}_pass$PASS.err
  done
done
python - $OUT <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(path.read_text().splitlines()[-1])
    print(path.stem, {k: d.get(k) for k in ("tau", "num_rounds", "draft_ms_per_round", "verify_ms_per_round", "tokens_per_s")})
PY
