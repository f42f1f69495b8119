#!/usr/bin/env bash
# Session 21, after both arms of the depth A/B trained (run 17: 2 layers, run 18: LAYERS=3, grown; both 250 steps
# from run 16, seed 12): the 10-prompt evaluation at T = 0 in this machine's float32 (tau per domain and the draft /
# verify ms per round), then the paired teacher-forced scores of run 16 (shipped), run 17 and run 18 on the target's
# answers to 40 prompts a set (paired.sh). Run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=training/session21/ab
mkdir -p $OUT
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 10 --max-new-tokens 96 --json)
for RUN in run17 run18; do
  cp runs/$RUN/train_log.jsonl $OUT/train_log_$RUN.jsonl
  dspark eval --drafter runs/$RUN/final "${EVAL[@]}" --temperature 0 > $OUT/eval10_T0_$RUN.json 2> $OUT/eval10_T0_$RUN.err
done
bash training/session19/paired.sh $OUT/paired dspark/checkpoints/smollm2-135m-dspark runs/run17/final runs/run18/final \
    > $OUT/paired.out 2>&1
python - $OUT training/run16/eval10_T0_run16.json <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in [pathlib.Path(sys.argv[2]), *sorted(out.glob("eval10_T0_*.json"))]:
    d = json.loads(path.read_text().splitlines()[-1])
    print(path.name, "tau", round(d["tau"], 4), {k: round(v["tau"], 4) for k, v in d["domains"].items()},
          "pos1-3", [round(x, 3) for x in d["position_acceptance"][:3]],
          "draft ms", round(d.get("draft_ms_per_round", float("nan")), 2),
          "verify ms", round(d.get("verify_ms_per_round", float("nan")), 2))
PY
cat $OUT/paired.out | tail -6
echo done
