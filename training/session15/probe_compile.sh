#!/usr/bin/env bash
# Session 15: the whole one-request forward compiled by inductor (dense weights, freezing packs them) against the
# eager ragged forward (weights packed once), quiet machine, after the runtime benchmarks.
set -uo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
while pgrep -f "session15/after_run10.sh" > /dev/null; do sleep 20; done
python scripts/probe_compile.py --tokens 1 8 --repeats 21 --plain-weights --freezing \
    > training/session15/probe_compile_freezing.json 2> training/session15/probe_compile_freezing.err
python scripts/probe_compile.py --tokens 1 8 --repeats 21 --plain-weights --freezing --cpp-wrapper \
    > training/session15/probe_compile_cpp.json 2> training/session15/probe_compile_cpp.err
echo done
