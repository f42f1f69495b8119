#!/usr/bin/env bash
# Session 21: what a third draft layer costs per round. The shipped drafter saved with 2 and with 3 draft layers (the
# third grown, adding nothing: grow_untrained.py), timed side by side by training/draft_cost.sh (float32, this AVX2
# CPU's auto, quiet machine); tau must be equal, draft ms per round is the cost.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
python training/session21/grow_untrained.py /tmp/grow
bash training/draft_cost.sh "${OUT:-training/session21/depth_cost}" /tmp/grow/layers2 /tmp/grow/layers3
