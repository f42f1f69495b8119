#!/usr/bin/env bash
# Session 20: what a larger draft vocabulary costs per round. The same drafter with its vocabulary chosen again on
# corpus v8 at 8,192 / 12,288 / 16,384 ids (untrained: refresh_vocab.py writes /tmp/refresh/v<N>), timed side by side
# by training/draft_cost.sh (float32, this AVX2 CPU's auto; the training run stopped with SIGSTOP meanwhile).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash training/draft_cost.sh "${OUT:-training/session20/draft_cost}" /tmp/refresh/v8192 /tmp/refresh/v12288 /tmp/refresh/v16384
