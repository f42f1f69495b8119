#!/usr/bin/env bash
# Session 17: session 15's speed run (training/session15/speed_gate.sh: 4 humaneval x 128, bf16, HF and llama.cpp peers)
# with this session's gate (lookup hits out of its measure, margin 10%/sqrt(R)); training/session17/speed.*
set -euo pipefail
cd "$(dirname "$0")/../.."
bash training/session15/speed_gate.sh training/session17/speed
