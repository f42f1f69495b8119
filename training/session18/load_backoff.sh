#!/usr/bin/env bash
# Session 18: load_margin.sh (session 17) again with the gate's session 18 changes: a number of requests first seen
# before its neighbour was measured borrows once it is, rounds carrying a prompt chunk take the best known mode
# instead of measuring or retrying, and each retry of the loser that loses again doubles the wait (at most 8x).
# Argument: the output name under training/session18/ (default load_backoff).
set -euo pipefail
cd "$(dirname "$0")/../.."
NAME=${1:-load_backoff}
bash training/session15/load_gate3.sh ../session18/$NAME --gate-trace training/session18/${NAME}_trace.jsonl
