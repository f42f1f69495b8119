#!/usr/bin/env bash
# Session 19, an AVX2-only 2-core AMD EPYC (no AVX512, no native bf16: `auto` = float32): the cost of k tokens per
# forward, and batch-1 greedy speed on 2 code prompts beside HF and llama.cpp, as sessions 15-17 measured on Zen 4
# (training/session15/speed_gate.sh). llama.cpp runs the f16 GGUF (its bf16 would be emulated here).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
E=../shared/eval_datasets; OUT=training/session19
dspark bench forward > $OUT/forward_avx2.json 2> $OUT/forward_avx2.err
dspark bench speed --dataset $E/humaneval.jsonl --num-prompts 2 --max-new-tokens 128 \
    --drafter dspark=default --drafter lookup=default+ngram --scheduler dspark \
    --peer llama.cpp --peer-gguf f16 --peer-threads 2 --json \
    > $OUT/speed_avx2.json 2> $OUT/speed_avx2.err
echo done
