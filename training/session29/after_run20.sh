#!/usr/bin/env bash
# Session 29 (2-core Intel Xeon with AMX: bf16 target and training), after run 20 trained (1,200 steps from run 16,
# the shipped drafter, with run 16's recipe: `RUN=run20 SEED=13 STEPS=1200 bash training/session19/run14.sh
# eval_every=400`): the 10-prompt evaluation at T = 0 of the shipped drafter and of run 20 through the same code in this
# machine's dtype, one after the other on a quiet machine; then one line per drafter.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=training/session29/eval; T=${T:-0}
mkdir -p $OUT
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
cp runs/run20/train_log.jsonl $OUT/train_log_run20.jsonl
for PAIR in shipped:dspark/checkpoints/smollm2-135m-dspark run20:runs/run20/final; do
  NAME=${PAIR%%:*}; DRAFTER=${PAIR#*:}
  dspark eval --drafter "$DRAFTER" "${EVAL[@]}" --temperature "$T" "${@}" > $OUT/eval10_T${T}_$NAME.json \
      2> $OUT/eval10_T${T}_$NAME.err
done
python - $OUT/eval10_T${T}_shipped.json $OUT/eval10_T${T}_run20.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    d = json.loads(open(path).read().splitlines()[-1])
    print(path, d.get("dtype"), "tau", round(d["tau"], 4), {k: round(v["tau"], 4) for k, v in d["domains"].items()},
          "pos1-3", [round(x, 3) for x in d["position_acceptance"][:3]],
          "draft ms", round(d.get("draft_ms_per_round", float("nan")), 2),
          "verify ms", round(d.get("verify_ms_per_round", float("nan")), 2))
PY
