#!/usr/bin/env bash
# The 10-prompt evaluation (eval10: math500, humaneval, mbpp, mt-bench, 10 prompts each x 96 tokens) of the shipped
# drafter and of a run's final weights through the same code in this machine's dtype, one after the other on a quiet
# machine, then one line per drafter. RUN (the run under runs/), OUT (where the evaluations go), T (temperature, 0);
# further arguments go to `dspark eval`. Session 29: RUN=run20 OUT=training/session29/eval; session 30: RUN=run21
# OUT=training/session30/eval.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
E=../shared/eval_datasets; RUN=${RUN:?RUN=runNN}; OUT=${OUT:?OUT=training/sessionNN/eval}; T=${T:-0}
mkdir -p $OUT
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
cp runs/$RUN/train_log.jsonl $OUT/train_log_$RUN.jsonl
for PAIR in shipped:dspark/checkpoints/smollm2-135m-dspark $RUN:runs/$RUN/final; do
  NAME=${PAIR%%:*}; DRAFTER=${PAIR#*:}
  dspark eval --drafter "$DRAFTER" "${EVAL[@]}" --temperature "$T" "${@}" > $OUT/eval10_T${T}_$NAME.json \
      2> $OUT/eval10_T${T}_$NAME.err
done
python - $OUT/eval10_T${T}_shipped.json $OUT/eval10_T${T}_$RUN.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    d = json.loads(open(path).read().splitlines()[-1])
    print(path, d.get("dtype"), "tau", round(d["tau"], 4), {k: round(v["tau"], 4) for k, v in d["domains"].items()},
          "pos1-3", [round(x, 3) for x in d["position_acceptance"][:3]],
          "draft ms", round(d.get("draft_ms_per_round", float("nan")), 2),
          "verify ms", round(d.get("verify_ms_per_round", float("nan")), 2))
PY
