#!/usr/bin/env bash
# Session 18: load_closed.sh again (the same gate; this VM moves single levels by 10-25 points between runs), written
# as training/session18/load_closed2.*
set -euo pipefail
cd "$(dirname "$0")/../.."
bash training/session18/load_backoff.sh load_closed2
