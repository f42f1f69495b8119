#!/usr/bin/env bash
# Session 15: load_gate3.sh again after the gate's averages decay per round of either mode, with the run 10 drafter.
exec bash "$(dirname "$0")/load_gate3.sh" load_gate4
