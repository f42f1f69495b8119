#!/usr/bin/env bash
# Session 17: load_free.sh again with the gate's margin shrinking as 10%/sqrt(R) (DraftGate._drafting_wins), written as
# training/session17/load_margin.*
set -euo pipefail
cd "$(dirname "$0")/../.."
bash training/session15/load_gate3.sh ../session17/load_margin --gate-trace training/session17/load_margin_trace.jsonl
