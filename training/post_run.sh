#!/usr/bin/env bash
# Evaluate a finished training run against the shipped drafter, calibrate it, and time it (quiet machine).
#   training/post_run.sh RUN_DIR OUT_DIR      e.g. training/post_run.sh runs/run3 training/run3
set -euo pipefail
RUN=$1; OUT=$2; E=../shared/eval_datasets
mkdir -p "$OUT"
rm -rf "$OUT/drafter"; cp -r "${FINAL:-$RUN/final}" "$OUT/drafter"
cp "$RUN/train_log.jsonl" "$RUN/train_config.json" "$OUT/"
EVAL=(--dataset $E/math500.jsonl --dataset $E/humaneval.jsonl --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl
      --num-prompts 4 --max-new-tokens 96 --dtype bfloat16 --json)
for T in 0 1; do
  dspark eval --drafter "$OUT/drafter" "${EVAL[@]}" --temperature $T > "$OUT/eval_T$T.json" 2> "$OUT/eval_T$T.err"
done
summary() {  # tau overall / per domain / position 1-3, and expected tau, of eval JSONs
  python - "$@" <<'PY'
import json, sys
for path in sys.argv[1:]:
    d = json.loads(open(path).read().splitlines()[-1])
    print(path, "tau", d["tau"], {k: v["tau"] for k, v in d["domains"].items()}, "pos", d["position_acceptance"][:3],
          "expected", d["expected_tau"])
PY
}
summary "$OUT/eval_T0.json" "$OUT/eval_T1.json"
# calibrate a copy (STS at T = 0 and at T = 1, each stored for its temperature, on the prompts training
# held out), then evaluate it as it would ship
rm -rf "$OUT/shipped/drafter"; mkdir -p "$OUT/shipped"; cp -r "$OUT/drafter" "$OUT/shipped/drafter"
for T in 0 1; do
  dspark calibrate --drafter "$OUT/shipped/drafter" --corpus corpora/smollm2-135m-instruct.safetensors --num-prompts 40 \
      --max-new-tokens 128 --dtype bfloat16 --temperature $T --json > "$OUT/calibrate_T$T.json" 2> "$OUT/calibrate_T$T.err"
done
for T in 0 1; do
  dspark eval --drafter "$OUT/shipped/drafter" "${EVAL[@]}" --temperature $T > "$OUT/shipped/eval_T$T.json" \
      2> "$OUT/shipped/eval_T$T.err"
done
summary "$OUT/shipped/eval_T0.json" "$OUT/shipped/eval_T1.json"
