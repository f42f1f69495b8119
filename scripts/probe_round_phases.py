"""Where a round at one request goes, phase by phase (`python scripts/probe_round_phases.py [prompts] [passes]`).

Session 30's load run found a drafting round at concurrency 1 taking 28.9 ms for 1.55 tokens, against ~22 ms per
plain round, while the compiled verify of 8 tokens costs ~1.1x one token and the compiled draft ~3 ms: about 4 ms a
round was unaccounted for. This wraps the engine's phases (drafting, and within it the drafter's flush of pending
features and its compiled block; the schedule; the target forward, by verified tokens; the commit) with wall-clock
accumulators (~1 us each) and runs the default target and drafter compiled, as `dspark bench load --compile` does,
on mt-bench prompts x 48 tokens at one request: policies none, fixed-1, fixed-3 and dspark with its gate off (every
round drafts), and "dspark-flush", dspark with the committed positions projected eagerly before the compiled block as
before session 31 (the block then absorbs none), rotated per pass; then torch.profiler's op table of a few dspark
rounds. Quiet machine; compiles the graphs first (~8 minutes on 2 cores).
"""

import collections
import statistics
import sys
import time
from collections.abc import Callable

import torch

from dspark.drafters import DEFAULT_DRAFTER, load_drafter
from dspark.drafters.dspark import DSparkModel
from dspark.drafters.dspark_drafter import DSparkDrafter
from dspark.drafters.lookup_first import LookupFirstDrafter
from dspark.engine import Engine, Request, make_backend
from dspark.eval.datasets import load_prompts
from dspark.factory import build_engine, step_rates
from dspark.loading import load_target
from dspark.profiling import draft_cost
from dspark.ragged import RaggedBackend
from dspark.scheduler import RoundCost
from dspark.text import eos_token_ids, prompt_ids

#: (policy, phase) -> seconds; (policy, "rounds") -> count; forward times keyed by tokens verified
TOTALS: dict[tuple[str, str], float] = collections.defaultdict(float)
FORWARD: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
ROUNDS: dict[tuple[str, bool], list[float]] = collections.defaultdict(list)
POLICY = ["none"]


def timed(owner: type, name: str, phase: str, keyed: Callable | None = None) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - begin
            TOTALS[POLICY[0], phase] += elapsed
            if keyed is not None:
                FORWARD[POLICY[0], keyed(*args)].append(elapsed)

    setattr(owner, name, wrapper)


def step_wrapper() -> None:
    original = Engine.step

    def step(self):
        prefill = bool(self.waiting) or any(not r.prefilled for r in self.running)  # a prompt rides along
        verified_before = self.stats.num_verified
        policy = POLICY[0]
        POLICY[0] = "prefill" if prefill else policy  # its phases apart: they are not a decoding round's
        begin = time.perf_counter()
        try:
            events = original(self)
        finally:
            POLICY[0] = policy
        elapsed = time.perf_counter() - begin
        if not prefill:
            ROUNDS[POLICY[0], self.stats.num_verified > verified_before].append(elapsed)
            TOTALS[POLICY[0], "round"] += elapsed
            TOTALS[POLICY[0], "rounds"] += 1
            TOTALS[POLICY[0], "tokens"] += sum(len(tokens) for _, tokens in events)
        return events

    Engine.step = step


def main(num_prompts: int = 8, passes: int = 3) -> None:
    loaded = load_target("default", "auto")
    drafter = load_drafter(DEFAULT_DRAFTER, loaded.model).compiled()
    texts = load_prompts("../shared/eval_datasets/mt-bench.jsonl", num_prompts)
    prompts = [prompt_ids(loaded, t) for t in texts]
    eos = eos_token_ids(loaded)
    block_size = drafter.max_block_size
    # as `dspark bench load --compile` at --max-concurrency 8 (the cached profiles and the same warm-up)
    sps = step_rates(loaded, "dspark", block_size, 8, True, drafter.target_layer_ids)
    sps = RoundCost(sps.verify, draft_cost(loaded, drafter, 8, block_size))
    backend = make_backend(loaded.model, drafter.target_layer_ids, max_slots=8, compile=True)
    begin = time.perf_counter()
    backend.warm_up()
    drafter.warm_up()
    print(f"warm-up {time.perf_counter() - begin:.0f} s", file=sys.stderr)

    original_round = DSparkDrafter._compiled_round

    def session30_round(self, states, anchors):  # "dspark-flush": projected eagerly first, as before session 31
        if POLICY[0] == "dspark-flush":
            self.flush(states)
        return original_round(self, states, anchors)

    DSparkDrafter._compiled_round = session30_round
    timed(Engine, "_draft", "draft")
    timed(DSparkDrafter, "flush", "draft.flush")
    timed(DSparkDrafter, "_compiled_round", "draft.block")
    timed(DSparkModel, "confidence", "draft.confidence")
    timed(LookupFirstDrafter, "_lookup", "draft.lookup")
    timed(Engine, "_scheduled", "schedule")
    timed(RaggedBackend, "forward", "forward", keyed=lambda self, segments: sum(len(s.token_ids) for s in segments))
    timed(Engine, "_commit_all", "commit")
    timed(DSparkDrafter, "commit", "commit.drafter")
    step_wrapper()

    policies = ["none", "fixed-1", "fixed-3", "dspark", "dspark-flush"]
    for index in range(passes + 1):  # pass 0 warms every policy's path and is not counted
        for policy in policies[index % len(policies):] + policies[: index % len(policies)]:
            POLICY[0] = policy if index else "warm"
            engine = build_engine(loaded, drafter, scheduler=policy.removesuffix("-flush"), block_size=block_size,
                                  sps=sps, max_concurrency=1, draft_gate=False, compile=True)
            requests = [Request(p, 48, eos_token_ids=eos) for p in prompts[: 2 if not index else None]]
            engine.run(requests)

    print(f"{'policy':8} {'rounds':>6} {'ms/round':>8} {'tok/round':>9} {'draft':>6} {'flush':>6} {'block':>6} "
          f"{'conf':>6} {'lookup':>6} {'sched':>6} {'fwd':>6} {'commit':>6} {'c.draft':>7} {'rest':>6}")
    for policy in policies:
        rounds = TOTALS[policy, "rounds"]
        phases = ("round", "draft", "draft.flush", "draft.block", "draft.confidence", "draft.lookup", "schedule",
                  "forward", "commit", "commit.drafter")
        ms = {k: 1e3 * TOTALS[policy, k] / rounds for k in phases}
        rest = ms["round"] - ms["draft"] - ms["schedule"] - ms["forward"] - ms["commit"]
        tokens = TOTALS[policy, "tokens"] / rounds
        print(f"{policy:8} {rounds:6.0f} {ms['round']:8.2f} {tokens:9.2f} {ms['draft']:6.2f} "
              f"{ms['draft.flush']:6.2f} {ms['draft.block']:6.2f} {ms['draft.confidence']:6.2f} "
              f"{ms['draft.lookup']:6.2f} {ms['schedule']:6.2f} {ms['forward']:6.2f} "
              f"{ms['commit']:6.2f} {ms['commit.drafter']:7.2f} {rest:6.2f}")
    print("target forward, median ms by tokens in the round (policy: tokens=ms[count])")
    for policy in policies:
        cells = [f"{n}={1e3 * statistics.median(v):.2f}[{len(v)}]" for (p, n), v in sorted(FORWARD.items())
                 if p == policy and n <= 16]
        print(f"  {policy:8} " + " ".join(cells))
    for policy in policies:
        for drafted in (False, True):
            times = ROUNDS[policy, drafted]
            if times:
                print(f"  {policy:8} {'drafting' if drafted else 'plain':8} rounds {len(times):5} "
                      f"median {1e3 * statistics.median(times):.2f} ms")
    op_profile(loaded, drafter, prompts, eos, block_size, sps)


def op_profile(loaded, drafter, prompts, eos, block_size, sps, rows: int = 30) -> None:
    """torch.profiler's per-op table of dspark rounds at one request (ops by self CPU time, with counts): which
    eager ops a drafting round still dispatches around the two compiled graphs."""
    from torch.profiler import ProfilerActivity, profile

    POLICY[0] = "profiled"
    engine = build_engine(loaded, drafter, scheduler="dspark", block_size=block_size, sps=sps, max_concurrency=1,
                          draft_gate=False, compile=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.run([Request(p, 48, eos_token_ids=eos) for p in prompts[:2]])
    rounds = TOTALS["profiled", "rounds"]
    print(f"op profile of {rounds:.0f} dspark rounds (+ 2 prefills)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


if __name__ == "__main__":
    torch.manual_seed(0)
    main(*(int(a) for a in sys.argv[1:3]))
