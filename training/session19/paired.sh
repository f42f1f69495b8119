#!/usr/bin/env bash
# Session 19: a paired comparison of drafters on the evaluation prompts, at T = 0 and T = 1. The target answers the
# first N prompts of each evaluation set once per temperature (greedy; T = 1 with top-p 1, seed 0), and every drafter
# is scored teacher-forced on those same answers (`dspark train --score`: every answer position an anchor; T = 0:
# the argmax agreement, which on the target's greedy text is the acceptance a greedy round starting there gets;
# T = 1: 1 + sum of prod (1 - TV), the expected acceptance length of a sampled round). Rollouts at T = 1 are unpaired:
# each drafter samples its own text, and one drafter's tau moves ~3% between seeds on 40 prompts.
# Each score is reported twice: the mean over every anchor, and in rollout order (chained_rounds: tokens / rounds of a
# rollout along the same text), which is what `dspark eval` measures.
#   bash training/session19/paired.sh OUT_DIR DRAFTER...      (answers cached in $WORK, never committed)
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
OUT=$1; shift
E=../shared/eval_datasets; WORK=${WORK:-/tmp/dspark_paired}; N=${N:-40}; TOKENS=${TOKENS:-128}
DTYPE=${DTYPE:-float32}; TEMPS=${TEMPS:-0 1}  # session 35: DTYPE=auto TEMPS=0 (the evaluation's bf16 greedy text)
mkdir -p "$WORK" "$OUT"
if [ ! -s "$WORK/prompts.jsonl" ]; then  # the first N prompts of each set, tagged with the set (a scratch file)
  python - "$WORK/prompts.jsonl" "$N" $E/math500.jsonl $E/humaneval.jsonl $E/mbpp.jsonl $E/mt-bench.jsonl <<'PY'
import json, sys
from dspark.eval.datasets import dataset_name, load_prompts
out, n, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
with open(out, "w") as handle:
    for path in paths:
        for i, prompt in enumerate(load_prompts(path, n)):
            handle.write(json.dumps({"id": f"{dataset_name(path)}:{i}", "source": dataset_name(path), "turns": [prompt]}) + "\n")
PY
fi
for T in $TEMPS; do
  if [ ! -s "$WORK/answers_T$T.safetensors" ]; then
    dspark data regenerate --prompts "$WORK/prompts.jsonl" --out "$WORK/answers_T$T.jsonl" --temperature $T \
        --top-p 1.0 --max-new-tokens $TOKENS --batch-size 16 --threads 2 --dtype $DTYPE --seed 0
    dspark data pack --jsonl "$WORK/answers_T$T.jsonl" --out "$WORK/answers_T$T.safetensors" --temperature $T \
        --top-p 1.0 --max-new-tokens $TOKENS
  fi
done
for DRAFTER in "$@"; do
  NAME=$(basename "$(dirname "$DRAFTER")")_$(basename "$DRAFTER")
  for T in $TEMPS; do
    dspark train --config configs/smollm2-dspark-cached.yaml --score init_from="$DRAFTER" \
        data="$WORK/answers_T$T.safetensors" feature_cache=null online_features=true seq_len=1024 threads=2 \
        progress=false > "$OUT/paired_T${T}_$NAME.json" 2> "$OUT/paired_T${T}_$NAME.err"
  done
done
python - "$OUT" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("paired_T*.json")):
    d = json.loads(path.read_text().splitlines()[-1])
    greedy = path.name.startswith("paired_T0")
    key, chained = ("eval_tau_greedy", "eval_rollout_tau_greedy") if greedy else ("eval_tau", "eval_rollout_tau")
    accept = "eval_accept_greedy" if greedy else "eval_accept"
    print(f"{path.stem:45s} tau (every anchor) {d[key]:.4f}", {s: round(v[key], 4) for s, v in d["sources"].items()},
          f"rollout-order {d.get(chained, float('nan')):.4f}",
          {s: round(v.get(chained, float("nan")), 4) for s, v in d["sources"].items()},
          "pos1", round(d[accept][0], 4), "blocks", int(d["eval_blocks"]))
PY
