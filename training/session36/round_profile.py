"""Where a c = 1 round's time goes, per policy (session 36): the engine's phases timed by wrappers.

Runs the load benchmark's requests (mt-bench, 16 × 48 tokens, c = 1, compiled, default+ngram) under each policy
and prints per round: drafting (the drafter's proposal, the lookup and gate decisions), scheduling, the target's
forward by number of tokens verified, committing, and what the engine does outside a round (gate bookkeeping).
Usage: python training/session36/round_profile.py [POLICY ...] (default: fixed-3 dspark).
"""

import collections
import os
import statistics
import sys
import time

import torch

import dspark.compiled
from dspark.bench_load import policy_gate, split_policy
from dspark.drafters import load_drafter
from dspark.engine import Engine, Request, make_backend
from dspark.eval.datasets import load_prompts
from dspark.factory import build_engine, step_rates
from dspark.loading import load_target
from dspark.profiling import draft_cost
from dspark.scheduler import RoundCost
from dspark.text import eos_token_ids, prompt_ids

TIMES: dict[str, list[float]] = collections.defaultdict(list)


def timed(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        TIMES[label].append(time.perf_counter() - start)
        return result

    setattr(owner, name, wrapper)


def main() -> None:
    if "ONEDNN_MIN_ROWS" in os.environ:  # 0 = every product oneDNN; a large number = inductor's own choice
        dspark.compiled.ONEDNN_MIN_ROWS = int(os.environ["ONEDNN_MIN_ROWS"])
    policies = sys.argv[1:] or ["fixed-3", "dspark"]
    loaded = load_target("default", "auto")
    drafter = load_drafter("default+ngram", loaded.model).compiled()
    prompts = [prompt_ids(loaded, t) for t in load_prompts("../shared/eval_datasets/mt-bench.jsonl", 16)][:16]
    sps = step_rates(loaded, "dspark", 7, 1, True, drafter.target_layer_ids)
    sps = RoundCost(sps.verify, draft_cost(loaded, drafter, 1, 7))
    backend = make_backend(loaded.model, drafter.target_layer_ids, max_slots=1, compile=True)
    backend.warm_up()
    drafter.warm_up()
    timed(Engine, "_draft", "draft")
    timed(Engine, "_scheduled", "schedule")
    timed(Engine, "_commit_all", "commit")
    timed(Engine, "step", "step")
    lengths: list[int] = []
    forward_by_length: dict[int, list[float]] = collections.defaultdict(list)
    original_forward = Engine._forward

    def forward(self, work):
        start = time.perf_counter()
        out = original_forward(self, work)
        if len(work) == 1 and work[0].draft is not None:
            n = int(work[0].segment.token_ids.shape[0])
            forward_by_length[n].append(time.perf_counter() - start)
            lengths.append(n)
        return out

    Engine._forward = forward
    eos = eos_token_ids(loaded)
    for repeat in range(1):
        for policy in policies:
            TIMES.clear()
            lengths.clear()
            forward_by_length.clear()
            gate = policy_gate(policy, 7)
            engine = build_engine(loaded, drafter, scheduler=split_policy(policy)[0], block_size=7,
                                  max_concurrency=1, sps=sps, as_named=True,
                                  draft_gate=False if gate is None else gate, compile=True)
            requests = [Request(ids, 48, eos_token_ids=eos) for ids in prompts]
            start = time.perf_counter()
            engine.run(requests)
            wall = time.perf_counter() - start
            tokens = sum(len(r.output_ids) for r in requests)
            rounds = len(TIMES["step"])
            print(f"== {policy} (pass {repeat}): {tokens / wall:.1f} tok/s, {rounds} rounds, "
                  f"τ {engine.stats.tau:.3f}, wall/round {1e3 * wall / rounds:.2f} ms")
            for label in ("step", "draft", "schedule", "commit"):
                values = TIMES[label]
                print(f"  {label:9s} mean {1e3 * statistics.mean(values):6.2f} ms  total {sum(values):6.2f} s")
            for n in sorted(forward_by_length):
                values = forward_by_length[n]
                print(f"  verify {n} tokens: {len(values):4d} rounds, median {1e3 * statistics.median(values):6.2f} ms")
            print(f"  outside steps: {wall - sum(TIMES['step']):.2f} s")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
