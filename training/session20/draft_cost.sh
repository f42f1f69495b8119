#!/usr/bin/env bash
# Session 20: what a larger draft vocabulary costs per round. The same drafter with its vocabulary chosen again on
# corpus v8 at 8,192 / 12,288 / 16,384 ids (untrained: refresh_vocab.py), `dspark eval` at T = 0 on 2 humaneval
# prompts x 96 tokens, float32 (this AVX2 CPU's auto), alternated twice; draft and verify ms per round.
# Run on a quiet machine (the training run stopped with SIGSTOP meanwhile).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=${OUT:-training/session20/draft_cost}; mkdir -p $OUT
for PASS in 1 2; do
  for V in 8192 12288 16384; do
    dspark eval --drafter /tmp/refresh/v$V --dataset $E/humaneval.jsonl --num-prompts 2 --max-new-tokens 96 \
        --temperature 0 --json > $OUT/v${V}_pass$PASS.json 2> $OUT/v${V}_pass$PASS.err
  done
done
python - $OUT <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(path.read_text().splitlines()[-1])
    o = d.get("overall", d)
    print(path.stem, {k: o.get(k) for k in ("tau", "draft_ms_per_round", "verify_ms_per_round", "tokens_per_s")})
PY
