#!/usr/bin/env bash
# Session 18: load_backoff.sh again after one more gate change: a plain (closed) round that verifies a lookup draft
# is not measured (Engine._unmeasured: "free"); written as training/session18/load_closed.*
set -euo pipefail
cd "$(dirname "$0")/../.."
bash training/session18/load_backoff.sh load_closed
