#!/usr/bin/env bash
# Session 17: a second run of load_free.sh (the same seven policies, the same gate), written as
# training/session17/load_free2.*: two runs of one configuration, as this VM's spread (none at c = 4 read 95.2 and
# 80.7 tokens/s in two runs an hour apart) makes one run of a change unreadable.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash training/session15/load_gate3.sh ../session17/load_free2 --gate-trace training/session17/load_free2_trace.jsonl
