"""Probe: where a dspark round spends its time when the draft gate is closed, against no speculation.

    python scripts/profile_closed_gate.py [CONCURRENCY] [THREADS]   # mt-bench prompts, 48 tokens, default drafter

Under load the gate closes drafting in ~95% of rounds, yet dspark kept only ~0.87 of no speculation (session 15,
bench load c = 8): this profiles both policies on the same requests (cProfile, per-function self time) to show
which work the closed-gate rounds still do.
"""

import cProfile
import pstats
import sys
import time

import torch

from dspark.drafters import load_drafter
from dspark.engine import Request
from dspark.eval.datasets import load_prompts
from dspark.factory import build_engine
from dspark.gate import DraftGate
from dspark.loading import load_target
from dspark.text import eos_token_ids, prompt_ids


class ClosedGate(DraftGate):
    def should_draft(self, num_requests: int) -> bool:
        return False


def serve(loaded, drafter, prompts, scheduler: str, concurrency: int, gate) -> tuple[float, int]:
    engine = build_engine(loaded, drafter, scheduler=scheduler, max_concurrency=concurrency, as_named=True,
                          draft_gate=gate)
    requests = [Request(ids, 48, eos_token_ids=eos_token_ids(loaded)) for ids in prompts]
    start = time.perf_counter()
    engine.run(requests)
    return time.perf_counter() - start, engine.stats.num_rounds


def main() -> None:
    concurrency = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    loaded = load_target("default", "auto")
    drafter = load_drafter("default+ngram", loaded.model)
    texts = load_prompts("../shared/eval_datasets/mt-bench.jsonl", 8)
    prompts = [prompt_ids(loaded, text) for text in texts]
    runs = {"none": ("none", False), "dspark-closed": ("dspark", ClosedGate())}
    for scheduler, gate in runs.values():
        serve(loaded, drafter, prompts[:2], scheduler, concurrency, gate)  # warm-up
    per_round = {}
    for name, (scheduler, gate) in runs.items():
        profile = cProfile.Profile()
        profile.enable()
        seconds, rounds = serve(loaded, drafter, prompts, scheduler, concurrency, gate)
        profile.disable()
        per_round[name] = seconds / rounds
        print(f"== {name}: {rounds} rounds")
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    print(f"closed-gate dspark / no speculation, time a round (same run): "
          f"{per_round['dspark-closed'] / per_round['none']:.3f}")


if __name__ == "__main__":
    main()
