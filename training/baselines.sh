#!/usr/bin/env bash
# Budget-matched drafters (issue 12, item 7): DSpark, DFlash, EAGLE-3 and MTP-1 trained on the committed corpus
# with the same batches, anchors and steps (online features: no cache to build), then evaluated as post_run.sh does.
#   training/baselines.sh OUT_DIR TYPE...     e.g. training/baselines.sh training/matched dspark dflash
#   THREADS=n (default 2): torch threads per run (two runs side by side: THREADS=1 each).
#   STEPS=n (default 620): 620 steps x 4 sequences x every answer position ~ 3.2M supervised positions each,
#   10x the session-5 round (120 steps x 8 sequences x 48 anchors x 7 positions = 322,560).
# Runs resume (--resume latest) when their output directory holds checkpoints, so a session may stop between or
# inside runs. Each drafter gets its own recipe's defaults: DSpark / DFlash start from the target's top layers
# (the shipped recipe); EAGLE-3 (layers 1 / 14 / 27) and MTP-1 (the last layer) start from random weights and
# learn with cross-entropy, as they are published. All four predict the same reduced draft vocabulary (the 8,192
# most frequent answer tokens; EAGLE-3 publishes one too), so they differ only in architecture and loss, and the
# baselines' full-vocabulary LM head does not make their steps 6x dearer. VOCAB=full gives EAGLE-3 / MTP the
# full vocabulary instead.
set -euo pipefail
OUT=$1; shift; E=../shared/eval_datasets; STEPS=${STEPS:-620}; THREADS=${THREADS:-2}
BASELINE_VOCAB=(); if [ "${VOCAB:-}" = full ]; then BASELINE_VOCAB=(draft_vocab_size=null); fi
mkdir -p "$OUT"
COMMON=(--config configs/smollm2-dspark-cached.yaml feature_cache=null online_features=true seq_len=1024
        max_steps=$STEPS warmup_steps=50 save_every=50 eval_every=$STEPS keep_checkpoints=1 threads=$THREADS
        length_grouping=0)  # the data order of the first matched runs (session 10)
for TYPE in "$@"; do
  case $TYPE in
    dspark|dflash) EXTRA=(drafter_type=$TYPE) ;;
    eagle3) EXTRA=(drafter_type=eagle3 "target_layer_ids=[1,14,27]" "${BASELINE_VOCAB[@]}" init_from_target=false
                   last_context_input=false ce_first_steps=0 num_draft_layers=1) ;;
    mtp) EXTRA=(drafter_type=mtp "target_layer_ids=[29]" "${BASELINE_VOCAB[@]}" init_from_target=false
                last_context_input=false ce_first_steps=0 num_draft_layers=1) ;;
    *) echo "unknown drafter type $TYPE (dspark, dflash, eagle3, mtp)" >&2; exit 2 ;;
  esac
  RUN=runs/matched_$TYPE
  RESUME=(); if compgen -G "$RUN/checkpoint-*" > /dev/null; then RESUME=(--resume latest); fi
  if [ ! -e "$RUN/final" ]; then
    dspark train "${COMMON[@]}" "${EXTRA[@]}" output_dir=$RUN "${RESUME[@]}" 2> "$OUT/${TYPE}_train.err"
  fi
  cp "$RUN/train_log.jsonl" "$OUT/${TYPE}_train_log.jsonl"
  for T in 0 1; do
    OMP_NUM_THREADS=$THREADS dspark eval --drafter "$RUN/final" --dataset $E/math500.jsonl --dataset $E/humaneval.jsonl \
        --dataset $E/mbpp.jsonl --dataset $E/mt-bench.jsonl --num-prompts 4 --max-new-tokens 96 --dtype bfloat16 \
        --temperature $T --json > "$OUT/${TYPE}_eval_T$T.json" 2> "$OUT/${TYPE}_eval_T$T.err"
  done
done
python - "$OUT" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*_eval_T*.json")):  # tau overall / per domain / positions 1-3
    d = json.loads(path.read_text().splitlines()[-1])
    print(path.name.removesuffix(".json"), "tau", d["tau"], {k: v["tau"] for k, v in d["domains"].items()},
          "pos", d["position_acceptance"][:3], "draft ms/round", d.get("draft_ms_per_round"))
PY
