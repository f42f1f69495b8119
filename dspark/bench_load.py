"""Benchmarks of the batched runtime.

`dspark bench load`: throughput under load. For each concurrency level, every policy (no
speculation, fixed-n, threshold, dspark, dspark-async) serves the same requests through the engine,
policies interleaved in a rotating order so they share the machine's conditions. Reports aggregate
tokens/s, per-user tokens/s, the median time from admission to first token (prefill: what separates the gate's
measured rounds from a whole run) and the verification budget (drafts verified per request per round).

`dspark bench ragged`: the two attention layouts of the ragged forward, side by side.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.drafters import load_drafter
from dspark.engine import Request, make_backend
from dspark.errors import DsparkError
from dspark.eval.datasets import load_prompts
from dspark.factory import build_engine, resolve_gate, step_rates
from dspark.gate import DraftGate
from dspark.loading import load_target, target_dtype_name
from dspark.profiling import draft_cost
from dspark.ragged import RaggedBackend, Segment
from dspark.scheduler import RoundCost, plans_drafting, resolve_block_size
from dspark.text import eos_token_ids, prompt_ids

DEFAULT_POLICIES = ("none", "fixed-1", "fixed-3", "fixed-5", "fixed-7", "threshold", "dspark", "dspark-async")


def concurrency_levels(max_concurrency: int) -> list[int]:
    levels, level = [], 1
    while level < max_concurrency:
        levels.append(level)
        level *= 2
    return [*levels, max_concurrency]


def split_policy(policy: str) -> tuple[str, bool | None]:
    """("dspark", False) for "dspark:no-gate": the scheduler's name and whether it runs with the draft gate
    (None: its default)."""
    name, _, gate = policy.partition(":")
    if gate not in ("", "gate", "no-gate"):
        raise DsparkError(f"unknown policy suffix {gate!r} in {policy!r} (use NAME, NAME:gate or NAME:no-gate)")
    return name, None if not gate else gate == "gate"


def policy_gate(policy: str, block_size: int) -> DraftGate | None:
    """The draft gate one policy keeps for the whole benchmark: its measurements carry from pass to pass and
    level to level (by number of requests), as a server's do from request to request."""
    name, gate = split_policy(policy)
    return resolve_gate(gate, name, block_size)


def run_level(loaded, drafter, prompts: list[torch.Tensor], policy: str, concurrency: int, max_new_tokens: int,
              block_size: int, sps, gate: DraftGate | None = None, compile: bool = False) -> dict:
    """Serve every prompt with `policy` at `concurrency`; aggregate and per-user speed."""
    engine = build_engine(loaded, drafter, scheduler=split_policy(policy)[0], block_size=block_size,
                          max_concurrency=concurrency, sps=sps, as_named=True,
                          draft_gate=False if gate is None else gate, compile=compile)
    eos = eos_token_ids(loaded)
    requests = [Request(ids, max_new_tokens, eos_token_ids=eos) for ids in prompts]
    start = time.perf_counter()
    engine.run(requests)
    wall = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in requests)
    per_user = statistics.mean(len(r.output_ids) / r.stats.total_time for r in requests if r.stats.total_time > 0)
    first_token = statistics.median(r.stats.prefill_time for r in requests)
    stats = engine.stats
    return {
        "throughput": tokens / wall,
        "per_user": per_user,
        "first_token_ms": 1e3 * first_token,  # admission to first token: prefill (and what it waits for in the round)
        "budget": stats.verified_per_request,  # the JSON key stays
        "tau": stats.tau,
        "scheduler_share": stats.scheduler_time / stats.round_time if stats.round_time else 0.0,
        "outputs": [r.output_ids for r in requests],
    }


def _median_pass(rows: list[dict]) -> dict:
    """A policy's passes at one level: the median throughput, per-user speed and time to first token (timings are
    noisy on a shared machine), the rest from the first pass (greedy outputs and counts repeat)."""
    return {**rows[0], **{key: statistics.median(r[key] for r in rows)
                          for key in ("throughput", "per_user", "first_token_ms")}}


def run_load_bench(args: argparse.Namespace) -> dict:
    loaded = load_target(args.target, args.dtype)
    compile = getattr(args, "compile", False)
    drafter = load_drafter(args.drafter, loaded.model)
    drafter = drafter.compiled() if compile else drafter  # its profiled cost is the compiled round's
    block_size = resolve_block_size(args.block_size, drafter_limit=drafter.max_block_size)
    texts = [text for dataset in args.dataset for text in load_prompts(dataset, args.num_requests)]
    prompts = [prompt_ids(loaded, text) for text in texts[: args.num_requests]]
    policies = args.policy or list(DEFAULT_POLICIES)
    levels = concurrency_levels(args.max_concurrency)
    names = [split_policy(p)[0] for p in policies]
    sps = None  # one profile, for the largest concurrency, shared by every level
    if any(name.startswith("dspark") for name in names):  # compiled: the compiled forward's rates, cached apart
        sps = step_rates(loaded, "dspark", block_size, args.max_concurrency, compile,
                         drafter.target_layer_ids if compile else ())
    if any(plans_drafting(name) for name in names) and block_size > 0:  # drafting cost, once for all levels
        sps = RoundCost(sps.verify, draft_cost(loaded, drafter, args.max_concurrency, block_size))

    results: dict[str, dict[str, list]] = {p: {"throughput": [], "per_user": [], "first_token_ms": [],
                                               "budget": [], "tau": [], "scheduler_share": [],
                                               "identical_to_none": []} for p in policies}
    gates = {p: policy_gate(p, block_size) for p in policies}
    trace = open(args.gate_trace, "w") if args.gate_trace else None  # written pass by pass, closed below
    if trace is not None:
        for gate in filter(None, gates.values()):
            gate.trace = []
    run_level(loaded, drafter, prompts[:1], policies[0], 1, 4, block_size, sps)  # warm-up
    if compile:  # every graph compiled before the first timed pass (engines share them through the model)
        backend = make_backend(loaded.model, drafter.target_layer_ids, max_slots=args.max_concurrency, compile=True)
        getattr(backend, "warm_up", lambda: 0)()
        drafter.warm_up()
    for index, level in enumerate(levels):
        passes: dict[str, list[dict]] = {p: [] for p in policies}
        for repeat in range(args.repeats):  # each pass in another rotated order; a slow spell hits one pass
            shift = (index + repeat) % len(policies)
            for policy in policies[shift:] + policies[:shift]:
                passes[policy].append(run_level(loaded, drafter, prompts, policy, level, args.max_new_tokens,
                                                block_size, sps, gates[policy], compile))
                if trace is not None and gates[policy] is not None:
                    _write_trace(trace, gates[policy], policy, level, repeat)
        measured = {policy: _median_pass(rows) for policy, rows in passes.items()}
        reference = measured.get("none", measured[policies[0]])["outputs"]
        for policy in policies:
            row = measured[policy]
            for key in ("throughput", "per_user", "first_token_ms", "budget", "tau", "scheduler_share"):
                results[policy][key].append(round(row[key], 4))
            same = sum(a == b for a, b in zip(row["outputs"], reference, strict=True)) / len(reference)
            results[policy]["identical_to_none"].append(round(same, 4))
        line = "  ".join(f"{p}={measured[p]['throughput']:.1f}" for p in policies)
        print(f"[bench load] concurrency {level}: tokens/s {line}", file=sys.stderr)

    fixed = [p for p in policies if p.startswith("fixed")]
    report = {
        "benchmark": "load",
        "target": loaded.name,
        "dtype": target_dtype_name(loaded.model),
        "drafter": args.drafter,
        "block_size": block_size,
        "num_requests": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "compile": compile,
        "concurrency": levels,
        "policies": results,
    }
    if fixed and "dspark" in policies:
        report["dspark_vs_best_fixed"] = [
            round(results["dspark"]["throughput"][i] / max(results[p]["throughput"][i] for p in fixed), 4)
            for i in range(len(levels))
        ]
    baselines = [p for p in policies if p == "none" or p.startswith("fixed")]
    if baselines:  # the measure: a load-aware policy against the best of no speculation and every fixed γ
        report["vs_best_static"] = {
            p: [round(results[p]["throughput"][i] / max(results[b]["throughput"][i] for b in baselines), 4)
                for i in range(len(levels))]
            for p in policies if p.startswith("dspark")
        }
    report["draft_gate"] = {p: gate.summary() for p, gate in gates.items() if gate is not None}
    if trace is not None:
        trace.close()
        report["gate_trace"] = args.gate_trace
    if args.plot_dir:
        report["plots"] = plot_load(report, Path(args.plot_dir))
    _print_load_table(report)
    print(json.dumps(report))
    return report


def _write_trace(trace, gate: DraftGate, policy: str, level: int, repeat: int) -> None:
    """The gate's rounds of one pass as JSON lines (then forgotten): what each mode measured, round by round."""
    for row in gate.trace:
        trace.write(json.dumps({"policy": policy, "concurrency": level, "pass": repeat, **row}) + "\n")
    trace.flush()
    gate.trace.clear()


def _print_load_table(report: dict) -> None:
    print(f"{'policy':<14}" + "".join(f"{'c=' + str(c):>18}" for c in report["concurrency"]), file=sys.stderr)
    for name, row in report["policies"].items():
        cells = "".join(f"{t:>9.1f}/{u:<5.1f}b{b:<3.1f}" for t, u, b in
                        zip(row["throughput"], row["per_user"], row["budget"], strict=True))
        print(f"{name:<14}{cells}", file=sys.stderr)
    print("(aggregate tok/s / per-user tok/s, b = drafts verified per request per round)", file=sys.stderr)


def plot_load(report: dict, plot_dir: Path) -> list[str]:
    """Throughput vs per-user speed (paper Fig. 7) and verification budget vs concurrency (Fig. 8)."""
    from dspark.plots import plot_lines

    policies = report["policies"]
    frontier = plot_lines({name: (row["per_user"], row["throughput"]) for name, row in policies.items()},
                          plot_dir / "load_frontier.png", xlabel="per-user tokens/s", ylabel="aggregate tokens/s",
                          title="Throughput vs per-user speed (concurrency 1 → max)")
    budget = plot_lines({name: (report["concurrency"], row["budget"]) for name, row in policies.items()
                         if name != "none"}, plot_dir / "load_budget.png", xlabel="concurrency",
                        ylabel="drafts verified per request per round", title="Verification budget vs load",
                        log2_x=True)
    return [str(frontier), str(budget)]


def run_ragged_bench(args: argparse.Namespace) -> dict:
    """Loop vs padded attention in one ragged forward: R requests × (γ+1) tokens on `context` tokens."""
    loaded = load_target(args.target, args.dtype)
    generator = torch.Generator().manual_seed(0)
    vocab = min(int(loaded.model.get_output_embeddings().weight.shape[0]), 1000)
    rows = []
    for context in args.context_tokens:
        for requests in args.requests:
            backends = {mode: RaggedBackend(loaded.model, max_slots=requests, attention=mode)
                        for mode in ("loop", "padded")}
            lengths = [max(1, context - 16 * i) for i in range(requests)]  # ragged contexts
            for backend in backends.values():
                for length in lengths:
                    context_ids = torch.randint(0, vocab, (length,), generator=generator)
                    backend.forward([Segment(backend.allocate(), context_ids, "none")])
            block = torch.randint(0, vocab, (args.tokens_per_request,), generator=generator)
            times = {mode: [] for mode in backends}
            for _ in range(args.repeats):
                for mode, backend in backends.items():
                    start = time.perf_counter()
                    backend.forward([Segment(slot, block) for slot in range(requests)])
                    times[mode].append(time.perf_counter() - start)
                    for slot, length in enumerate(lengths):
                        backend.rollback(slot, length)
            loop, padded = (statistics.median(times[m]) for m in ("loop", "padded"))
            rows.append({"context": context, "requests": requests, "loop_ms": round(1000 * loop, 2),
                         "padded_ms": round(1000 * padded, 2), "padded_over_loop": round(padded / loop, 4)})
            print(f"[bench ragged] context {context} requests {requests}: loop {1000 * loop:.1f} ms, "
                  f"padded {1000 * padded:.1f} ms ({padded / loop:.3f}×)", file=sys.stderr)
    report = {"benchmark": "ragged", "target": loaded.name, "dtype": target_dtype_name(loaded.model),
              "tokens_per_request": args.tokens_per_request,
              "torch_threads": torch.get_num_threads(), "rows": rows}
    print(json.dumps(report))
    return report
