#!/usr/bin/env bash
# The 10-prompt evaluation (the first 10 prompts of math500, humaneval, mbpp and mt-bench, 96 tokens, this machine's
# target dtype) of each RUN's final drafter at temperature T (default 0), written to OUT/eval10_T${T}_RUN.json, then
# one line per drafter (the shipped one's recorded eval first) with tau overall / per domain, positions 1-3 and the
# draft / verify ms per round. Run on a quiet machine.
#   bash training/eval10.sh OUT RUN...      e.g. bash training/eval10.sh training/session22/eval runs/run18 runs/run19
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=$1; shift
E=../shared/eval_datasets; T=${T:-0}; SHIPPED=${SHIPPED:-training/run16/eval10_T0_run16.json}
mkdir -p "$OUT"
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
for RUN in "$@"; do
  NAME=$(basename "$RUN")
  cp "$RUN/train_log.jsonl" "$OUT/train_log_$NAME.jsonl"
  dspark eval --drafter "$RUN/final" "${EVAL[@]}" --temperature "$T" > "$OUT/eval10_T${T}_$NAME.json" \
      2> "$OUT/eval10_T${T}_$NAME.err"
done
python - "$SHIPPED" "$@" <<PY
import json, pathlib, sys
paths = [pathlib.Path(sys.argv[1])] + [pathlib.Path("$OUT") / f"eval10_T${T}_{pathlib.Path(r).name}.json" for r in sys.argv[2:]]
for path in paths:
    d = json.loads(path.read_text().splitlines()[-1])
    print(path.name, "tau", round(d["tau"], 4), {k: round(v["tau"], 4) for k, v in d["domains"].items()},
          "pos1-3", [round(x, 3) for x in d["position_acceptance"][:3]],
          "draft ms", round(d.get("draft_ms_per_round", float("nan")), 2),
          "verify ms", round(d.get("verify_ms_per_round", float("nan")), 2))
PY
