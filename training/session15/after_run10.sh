#!/usr/bin/env bash
# Session 15: once run 10 (training, calibration, evaluation) is done, the runtime benchmarks on the quiet machine.
set -uo pipefail
cd "$(dirname "$0")/../.."
while pgrep -f "training/session14/run10.sh" > /dev/null; do sleep 20; done
bash training/session15/load_gate.sh; echo "load rc=$?"
bash training/session15/speed_gate.sh; echo "speed rc=$?"
echo done
