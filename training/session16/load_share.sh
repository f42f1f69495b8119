#!/usr/bin/env bash
# Session 16: session 15's final load run (training/session15/load_gate3.sh: none, fixed-1/3/5, dspark with and
# without the gate, dspark-async; mt-bench 8 x 48, median of 3 passes) with the gate now borrowing a neighbouring
# number of requests' averages (DraftGate.share); the run 11 drafter (shipped this session); written as training/session16/load_share.*
set -euo pipefail
cd "$(dirname "$0")/../.."
bash training/session15/load_gate3.sh ../session16/load_share
