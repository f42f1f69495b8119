#!/usr/bin/env bash
# Session 17: a second run of load_margin.sh (the same gate), written as training/session17/load_margin2.*
set -euo pipefail
cd "$(dirname "$0")/../.."
bash training/session15/load_gate3.sh ../session17/load_margin2 --gate-trace training/session17/load_margin2_trace.jsonl
