"""Probe (`python scripts/probe_load_round.py [concurrency] [policy] [profile]`): where a round of R requests
goes, with the default target (bf16) and drafter, on mt-bench prompts: the ragged target forward alone (R requests
x 1 token on their caches) against the whole engine round, and with `profile [sort] [count]` a cProfile of 24 steady
rounds (top functions by own time, or by `sort`, e.g. cumtime)."""
import cProfile
import pstats
import statistics
import sys
import time

import torch

from dspark.drafters import load_drafter
from dspark.engine import Request
from dspark.eval.datasets import load_prompts
from dspark.factory import build_engine
from dspark.loading import load_target
from dspark.ragged import Segment
from dspark.text import prompt_ids

concurrency = int(sys.argv[1]) if len(sys.argv) > 1 else 8
policy = sys.argv[2] if len(sys.argv) > 2 else "none"
loaded = load_target("default", "bfloat16")
drafter = load_drafter("default+ngram", loaded.model)
engine = build_engine(loaded, drafter, scheduler=policy, max_concurrency=concurrency, as_named=True)
prompts = [prompt_ids(loaded, t) for t in load_prompts("../shared/eval_datasets/mt-bench.jsonl", concurrency)]
requests = [engine.add(Request(p, 200)) for p in prompts]
while not all(r.prefilled for r in requests):
    engine.step()
for _ in range(8):
    engine.step()


def round_time() -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def forward_time() -> float:
    segments = [Segment(r.slot, r.context[-1:]) for r in requests]
    lengths = [engine.backend.length(r.slot) for r in requests]
    start = time.perf_counter()
    engine.backend.forward(segments)
    elapsed = time.perf_counter() - start
    for r, length in zip(requests, lengths, strict=True):
        engine.backend.rollback(r.slot, length)
    return elapsed


rounds, forwards = [], []
for _ in range(12):
    rounds.append(round_time())
    forwards.append(forward_time())
print(f"R={concurrency} {policy}: round {1000 * statistics.median(rounds):.1f} ms, target forward alone "
      f"{1000 * statistics.median(forwards):.1f} ms (threads {torch.get_num_threads()})")
if len(sys.argv) < 4 or sys.argv[3] != "profile":
    sys.exit()
profile = cProfile.Profile()
profile.enable()
for _ in range(24):
    engine.step()
profile.disable()
sort_key = sys.argv[4] if len(sys.argv) > 4 else "tottime"
pstats.Stats(profile).sort_stats(sort_key).print_stats(int(sys.argv[5]) if len(sys.argv) > 5 else 18)
