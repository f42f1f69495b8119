#!/usr/bin/env bash
# Session 17: session 16's load run (training/session15/load_gate3.sh: none, fixed-1/3/5, dspark with and without the
# gate, dspark-async; mt-bench 8 x 48, median of 3 passes) with the gate no longer counting lookup hits (free drafts,
# made in either mode) as a mode's tokens, and every gated round traced; written as training/session17/load_free.*
set -euo pipefail
cd "$(dirname "$0")/../.."
bash training/session15/load_gate3.sh ../session17/load_free --gate-trace training/session17/load_free_trace.jsonl
