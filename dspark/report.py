"""`dspark report`: regenerate docs/RESULTS.md and its figures from one run (the top layer below
the server: it composes eval rollouts, calibration, the benchmarks and the plots).

Every number in the report comes from this run: real speculative rollouts through the engine on the
shared evaluation prompts (τ, per-position acceptance, calibration), the verify-length and threshold
sweeps replayed from those rounds, draft latency timed against one verification forward, and the
batch-1 speed benchmark with all methods interleaved per prompt.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dspark.cli_args import add_dtype_arg
from dspark.errors import DsparkError
from dspark.eval.datasets import load_dataset_prompts
from dspark.eval.evaluate import evaluation_report, threshold_sweep, verify_length_sweep
from dspark.eval.rollout import RoundRecord, all_rounds, run_rollouts

DEFAULT_DATASETS = ("math500", "humaneval", "mbpp", "mt-bench")


# ------------------------------------------------------------------------------- measuring


def environment() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "machine": platform.machine(),
            "processor": platform.processor() or "unknown", "cpu_count": _cpu_count(),
            "torch_threads": torch.get_num_threads(), "commit": commit or "unknown",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def draft_latency(loaded, drafter, gamma: int, repeats: int = 9) -> dict:
    """Median draft time per round for ℓ = 1..γ tokens and one verify forward of γ+1 tokens (ms)."""
    from dspark.engine import make_backend
    from dspark.ragged import Segment
    from dspark.sampling import SamplingParams
    from dspark.text import prompt_ids

    ids = prompt_ids(loaded, "Write a Python function that merges two sorted lists.")
    backend = make_backend(loaded.model, drafter.target_layer_ids, max_slots=1)
    slot = backend.allocate()
    prefill = backend.forward([Segment(slot, ids[:-1], "last")])[0]
    state = drafter.start(ids[:-1], prefill.hidden)
    block = torch.cat([ids[-1:], ids[: gamma]])
    timings: dict[str, list[float]] = {"verify": [], **{str(n): [] for n in range(1, gamma + 1)}}
    for _ in range(repeats):
        start = time.perf_counter()
        backend.forward([Segment(slot, block)])
        timings["verify"].append(time.perf_counter() - start)
        backend.rollback(slot, ids.shape[0] - 1)
        for n in range(1, gamma + 1):
            start = time.perf_counter()
            drafter.propose(state, ids, n, SamplingParams(), None)
            timings[str(n)].append(time.perf_counter() - start)
    return {key: round(1000 * float(np.median(values)), 3) for key, values in timings.items()}


def acceptance_section(loaded, drafters: dict, prompts, args) -> dict:
    """τ per dataset / domain and per-position acceptance, per drafter and temperature."""
    from dspark.sampling import SamplingParams
    from dspark.scheduler import resolve_block_size

    results = {}
    for name, drafter in drafters.items():
        gamma = resolve_block_size(None, drafter_limit=drafter.max_block_size)
        for temperature in args.temperature:
            started = time.perf_counter()
            rollouts = run_rollouts(loaded, drafter, prompts, max_new_tokens=args.max_new_tokens,
                                    sampling=SamplingParams(temperature), block_size=gamma, seed=args.seed)
            report = evaluation_report(rollouts, gamma)
            report["rounds"] = all_rounds(rollouts)
            report["seconds"] = round(time.perf_counter() - started, 1)
            results[f"{name}@T={temperature:g}"] = report
            print(f"[report] {name} T={temperature:g}: tau {report['tau']:.3f} ({report['seconds']} s)",
                  file=sys.stderr)
    return results


def calibration_section(loaded, drafter, rounds: list[RoundRecord], gamma: int, plot_path: Path,
                        sampling_temperature: float = 0.0) -> dict | None:
    """Reliability of a_k on evaluation rounds sampled at `sampling_temperature`, raw (T = 1) vs the
    checkpoint's calibration (temperatures and biases) for that sampling temperature."""
    from dspark.calibration import calibration_arrays, pooled_report, position_reports
    from dspark.train.calibrate import plot_calibration

    config = getattr(drafter, "config", None)
    temperatures, biases = (config.calibration_for(sampling_temperature) if hasattr(config, "calibration_for")
                            else (None, None))
    if temperatures is None or not any(r.raw_logits for r in rounds):
        return None
    logits, outcomes = calibration_arrays(rounds, gamma)
    plot_calibration(str(plot_path), logits, outcomes, temperatures, 10, biases)
    return {"temperatures": temperatures, "biases": biases,
            "pooled": pooled_report(logits, outcomes, temperatures, biases=biases),
            "positions": [p.to_dict() for p in position_reports(logits, outcomes, temperatures, biases=biases)]}


# ------------------------------------------------------------------------------- markdown


def _table(header: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if value is None:
            return "–"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def render(data: dict) -> str:
    env, args = data["environment"], data["args"]
    out = [
        f"# DSpark on {data.get('target', 'the target')}: results",
        "",
        f"Generated by `{data['command']}` on {env['date']} (commit {env['commit']}); every number below "
        "comes from that one run. Regenerate with the same command.",
        "",
        f"Machine: {env['cpu_count']} CPU cores ({env['machine']}, {env['processor']}), torch {env['torch']} "
        f"({env['torch_threads']} threads), transformers {env['transformers']}, Python {env['python']}. "
        f"Prompts: the first {args['num_prompts']} of each of {', '.join(args['datasets'])} "
        f"(`../shared/eval_datasets`), {args['max_new_tokens']} new tokens, chat template, seed {args['seed']}.",
        "",
        "## Acceptance length τ (tokens per round)",
        "",
    ]
    acceptance = data["acceptance"]
    datasets = list(next(iter(acceptance.values()))["datasets"]) if acceptance else []
    domains = list(next(iter(acceptance.values()))["domains"]) if acceptance else []
    out.append(_table(["drafter", "τ all", *[f"τ {d}" for d in datasets], *[f"τ {d}" for d in domains],
                       "accept rate", "draft ms/round", "verify ms/round"],
                      [[name, r["tau"], *[r["datasets"][d]["tau"] for d in datasets],
                        *[r["domains"][d]["tau"] for d in domains], r["acceptance_rate"],
                        r["draft_ms_per_round"], r["verify_ms_per_round"]] for name, r in acceptance.items()]))
    out += ["", "Per-position conditional acceptance (position k counted only when 1..k−1 were accepted; paper "
            "Fig. 2):", "", "![position acceptance](results/position_acceptance.png)", ""]
    width = max(len(r["position_acceptance"]) for r in acceptance.values())
    out.append(_table(["drafter", *[f"k={k + 1}" for k in range(width)]],
                      [[name, *r["position_acceptance"], *[None] * (width - len(r["position_acceptance"]))]
                       for name, r in acceptance.items()]))
    sweep, latency = data["verify_length_sweep"], data["latency"]
    out += ["", "## Verify length and draft latency (paper Fig. 4 analogue)", "",
            "τ if each round verified only its first ℓ drafts (replayed from the full-length T = 0 rounds of "
            f"`{data['sweep_drafter']}`), and the measured draft time for ℓ tokens against one target "
            f"verification forward of γ+1 tokens ({data['latency']['verify']:.1f} ms). The shipped drafter is "
            "trained for one block size; blocks beyond it would need drafters trained for them.", "",
            "![verify length](results/verify_length.png)", "",
            _table(["ℓ", "τ", "acceptance rate", "draft ms", "draft / verify"],
                   [[row["verify_length"], row["tau"], row["acceptance_rate"], latency[str(row["verify_length"])],
                     latency[str(row["verify_length"])] / latency["verify"]] for row in sweep])]
    if data.get("depth"):
        out += ["", "## Depth (paper Fig. 3 analogue): draft cost per layer", "",
                "Draft time per round (γ tokens) of untrained DSpark drafters of 1–5 layers, as a ratio to one "
                "verification forward (τ per depth needs one trained drafter per depth; see docs/training.md).",
                "", _table(["layers", "draft ms", "draft / verify"],
                           [[d["layers"], d["draft_ms"], d["ratio"]] for d in data["depth"]])]
    if data.get("block_sizes"):
        out += ["", "Block size γ (paper Fig. 4): draft time of a whole block of γ tokens (untrained 1-layer "
                "DSpark drafter with the shipped rank; latency does not depend on the weights) against one "
                "verification forward of γ + 1 tokens. τ beyond the shipped γ = 7 needs drafters trained for "
                "those blocks.", "", "![block size](results/block_size_latency.png)", "",
                _table(["γ", "draft ms", "verify ms (γ+1 tokens)", "draft / verify"],
                       [[r["block_size"], r["draft_ms"], r["verify_ms"], r["ratio"]] for r in data["block_sizes"]])]
    if data.get("thresholds"):
        out += ["", "## Confidence threshold (paper Fig. 5)", "",
                "Static cut 'verify while a_k ≥ t', replayed from the same rounds: fewer drafts verified per "
                "round, higher acceptance rate, fewer tokens per round.", "",
                "![threshold sweep](results/threshold_sweep.png)", "",
                _table(["t", "verified / round", "tokens / round", "acceptance rate"],
                       [[r["threshold"], r["verified_per_round"], r["tokens_per_round"], r["acceptance_rate"]]
                        for r in data["thresholds"]])]
    if data.get("calibration"):
        cal = data["calibration"]
        pooled = cal["pooled"]
        method = ("Sequential temperature scaling" if not cal.get("biases") else
                  f"Sequential Platt scaling, biases {[round(b, 3) for b in cal['biases']]} and")
        out += ["", "## Calibration (paper Fig. 6)", "",
                f"{method} temperatures {[round(t, 3) for t in cal['temperatures']]} "
                "(fitted by `dspark calibrate` on held-out training-side prompts), evaluated here on the "
                f"evaluation rounds: pooled ECE {pooled['ece_before']} → {pooled['ece_after']}, "
                f"AUC {pooled['auc_before']} → {pooled['auc_after']}.", "",
                "![reliability](results/reliability.png)", "",
                _table(["k", "n", "ECE raw", "ECE calibrated", "AUC raw", "AUC calibrated"],
                       [[p["position"], p["count"], p["ece_before"], p["ece_after"], p["auc_before"],
                         p["auc_after"]] for p in cal["positions"]])]
    expected = [[name, r["tau"], r["expected_tau_raw"], r["expected_tau"], r["expected_tau"] / r["tau"] - 1]
                for name, r in acceptance.items() if r.get("expected_tau") is not None]
    if expected:
        out += ["", "Expected τ predicted by the confidences (1 + Σ_k a_k per round, averaged) against the measured "
                "τ of the same rounds; the scheduler plans with these a_k.", "",
                _table(["drafter", "measured τ", "expected τ raw", "expected τ calibrated", "calibrated error"],
                       expected)]
    if data.get("speed"):
        speed = data["speed"]
        out += ["", "## Batch-1 speed (greedy, code prompts)", "",
                f"`dspark bench speed` on {speed['num_prompts']} prompts of {Path(speed['dataset']).name}, "
                f"{speed['max_new_tokens']} new tokens, every method interleaved per prompt in one process. "
                "Ratios only: the machine is shared and noisy.", "",
                _table(["method", "tokens/s", "× HF generate", "τ", "identical to HF"],
                       [[name, m["tokens_per_s"], m["speedup_vs_hf"], m["tau"], m["identical_to_hf"]]
                        for name, m in speed["methods"].items()])]
    out += ["", "## Where this differs from the paper", "", data["discussion"], ""]
    return "\n".join(out)


def discussion(data: dict) -> str:
    """The part of the comparison with the paper that numbers decide, generated from this run's numbers
    (a fixed text would go stale with every retrained drafter); the qualitative comparison is hand-written
    in docs/paper-comparison.md."""
    acceptance, latency = data["acceptance"], data["latency"]
    gamma = max((int(k) for k in latency if k.isdigit()), default=0)
    draft_share = latency[str(gamma)] / latency["verify"] if gamma else None
    lines = []
    for name, report in acceptance.items():
        first = (report["position_acceptance"] or [None])[0]
        line = f"`{name}`: τ {report['tau']:.2f} tokens per round"
        lines.append(line if first is None else f"{line}, position-1 acceptance {first:.2f}")
    text = "Measured in this run: " + "; ".join(lines) + "."
    if draft_share is not None:
        text += (f" Drafting a block of {gamma} costs {draft_share:.2f}× one verification forward, so a round costs "
                 f"{1 + draft_share:.2f} verification forwards and speculation pays only where τ exceeds that times "
                 "the ratio of one verification forward to one plain decoding step (see the speed table).")
    return text + (" The paper's drafters (5 layers, 4B–14B targets, ~10⁹ training tokens on GPUs) reach τ ≈ 5 on "
                   "math and code; docs/paper-comparison.md says which of its findings carry over here and why.")


def plot_sweeps(data: dict, plot_dir: Path) -> None:
    from dspark.plots import new_figure, plot_position_acceptance

    plot_position_acceptance({n: r["position_acceptance"] for n, r in data["acceptance"].items()},
                             plot_dir / "position_acceptance.png")
    with new_figure(plot_dir / "verify_length.png") as (fig, ax):
        sweep = data["verify_length_sweep"]
        lengths = [r["verify_length"] for r in sweep]
        ax.plot(lengths, [r["tau"] or 0.0 for r in sweep], marker="o", label="τ")
        ax.set_xlabel("drafts verified per round ℓ")
        ax.set_ylabel("τ")
        twin = ax.twinx()
        twin.plot(lengths, [data["latency"][str(n)] / data["latency"]["verify"] for n in lengths], marker="s",
                  color="tab:red", label="draft / verify time")
        twin.set_ylabel("draft time / verify time")
        fig.legend(loc="upper left", fontsize=8)
    if data.get("block_sizes"):
        with new_figure(plot_dir / "block_size_latency.png") as (fig, ax):
            rows = data["block_sizes"]
            sizes = [r["block_size"] for r in rows]
            ax.plot(sizes, [r["draft_ms"] for r in rows], marker="o", label="draft (γ tokens)")
            ax.plot(sizes, [r["verify_ms"] for r in rows], marker="s", label="verify (γ + 1 tokens)")
            ax.set_xlabel("block size γ")
            ax.set_ylabel("ms")
            ax.legend(fontsize=8)
    if data.get("thresholds"):
        with new_figure(plot_dir / "threshold_sweep.png") as (fig, ax):
            rows = data["thresholds"]
            ts = [r["threshold"] for r in rows]
            ax.plot(ts, [r["tokens_per_round"] or 0.0 for r in rows], marker="o", label="tokens / round")
            ax.plot(ts, [r["verified_per_round"] for r in rows], marker="s", label="verified / round")
            ax.set_xlabel("threshold t")
            twin = ax.twinx()
            twin.plot(ts, [r["acceptance_rate"] or 0.0 for r in rows], marker="^", color="tab:green",
                      label="acceptance rate")
            twin.set_ylim(0, 1)
            fig.legend(loc="upper right", fontsize=8)


# ------------------------------------------------------------------------------------ CLI


def add_report_parser(subparsers) -> None:
    parser = subparsers.add_parser("report", help="regenerate docs/RESULTS.md and its figures from one run")
    parser.add_argument("--target", default="default")
    parser.add_argument("--drafter", action="append", default=None,
                        help="NAME=SPEC drafters to compare (repeatable; default dspark=default, lookup=default+ngram "
                             "and ngram=ngram)")
    parser.add_argument("--dataset", action="append", default=None,
                        help="prompt JSONL (repeatable; default math500, humaneval, mbpp, mt-bench from "
                             "../shared/eval_datasets)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, action="append", default=None,
                        help="sampling temperatures for τ (repeatable; default 0 and 1)")
    parser.add_argument("--speed-prompts", type=int, default=4, help="code prompts for the speed table (0 = skip)")
    parser.add_argument("--depth", type=int, default=5, help="time untrained drafters of 1..N layers (0 = skip)")
    parser.add_argument("--block-sizes", type=_block_sizes, default=[4, 6, 8, 10, 12, 14, 16],
                        help="comma-separated γ for the draft-latency sweep ('' = skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/RESULTS.md")
    parser.add_argument("--plot-dir", default=None, help="default: a results/ folder next to --out")
    add_dtype_arg(parser)
    parser.set_defaults(handler=run_report)


def run_report(args: argparse.Namespace) -> dict:
    from dspark.drafters import load_drafter
    from dspark.eval.datasets import default_dataset
    from dspark.loading import load_target, target_dtype_name

    if args.num_prompts <= 0 or args.max_new_tokens <= 0:
        raise DsparkError("--num-prompts and --max-new-tokens must be > 0")
    specs = dict(_name_spec(s) for s in (args.drafter or ["dspark=default", "lookup=default+ngram", "ngram=ngram"]))
    paths = args.dataset or [str(default_dataset(name)) for name in DEFAULT_DATASETS]
    args.temperature = args.temperature or [0.0, 1.0]
    out = Path(args.out)
    plot_dir = Path(args.plot_dir) if args.plot_dir else out.parent / "results"
    plot_dir.mkdir(parents=True, exist_ok=True)

    loaded = load_target(args.target, args.dtype)
    drafters = {name: load_drafter(spec, loaded.model) for name, spec in specs.items()}
    prompts = load_dataset_prompts(paths, args.num_prompts)
    data: dict = {"command": "dspark " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["report"] else "dspark report",
                  "environment": environment(), "target": loaded.name,
                  "args": {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                           "datasets": [Path(p).stem for p in paths], "drafters": specs}}
    data["acceptance"] = acceptance_section(loaded, drafters, prompts, args)

    sweep_name = next(iter(drafters))
    sweep_drafter = drafters[sweep_name]
    key = f"{sweep_name}@T={args.temperature[0]:g}"
    rounds = data["acceptance"][key]["rounds"]
    gamma = max([r.drafted for r in rounds] + [1])
    data["sweep_drafter"] = key
    data["verify_length_sweep"] = verify_length_sweep(rounds, gamma)
    data["latency"] = draft_latency(loaded, sweep_drafter, gamma)
    data["thresholds"] = threshold_sweep(rounds) if any(r.survival for r in rounds) else None
    data["calibration"] = calibration_section(loaded, sweep_drafter, rounds, gamma, plot_dir / "reliability.png",
                                              args.temperature[0])
    if args.depth > 0:
        data["depth"] = _depth_latency(loaded, args.depth, gamma)
    if args.block_sizes:
        data["block_sizes"] = _block_size_latency(loaded, args.block_sizes)
    if args.speed_prompts > 0:
        data["speed"] = _speed(args, loaded, paths, specs)
    data["discussion"] = discussion(data)
    plot_sweeps(data, plot_dir)
    for report in data["acceptance"].values():
        report.pop("rounds")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(data))
    summary = {"report": str(out), "dtype": target_dtype_name(loaded.model),
               "plots": sorted(str(p) for p in plot_dir.glob("*.png")),
               "tau": {name: r["tau"] for name, r in data["acceptance"].items()}}
    if data.get("speed"):
        summary["speedup_vs_hf"] = {n: m["speedup_vs_hf"] for n, m in data["speed"]["methods"].items()}
    print(json.dumps(summary))
    return data


def _block_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated block sizes, got {text!r}") from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"block sizes must be >= 1, got {text!r}")
    return sizes


def _name_spec(text: str) -> tuple[str, str]:
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec:
        raise DsparkError(f"--drafter takes NAME=SPEC (e.g. dspark=default), got {text!r}")
    return name, spec


def _draft_bench(target, block_size: int, max_layers: int) -> dict:
    """`dspark bench draft` of untrained DSpark drafters of 1..max_layers layers (rank 64, 9 repeats)."""
    from dspark.bench import run_draft_bench

    return run_draft_bench(argparse.Namespace(target=target, dataset=None, block_size=block_size,
                                              max_layers=max_layers, markov_rank=64, repeats=9, dtype="auto",
                                              draft_dtype="auto"))


def _depth_latency(target, max_layers: int, gamma: int) -> list[dict]:
    report = _draft_bench(target, gamma, max_layers)
    return [{"layers": d, "draft_ms": report["drafters"][f"vanilla-{d}L"]["draft_ms"],
             "ratio": report["drafters"][f"vanilla-{d}L"]["ratio_to_verify"]} for d in range(1, max_layers + 1)]


def _block_size_latency(target, block_sizes: list[int]) -> list[dict]:
    """Draft time of a full block of γ tokens (untrained 1-layer DSpark drafter, rank 64: latency does
    not depend on the weights) against one verification forward of γ + 1 tokens, per γ (Fig. 4)."""
    rows = []
    for gamma in block_sizes:
        report = _draft_bench(target, gamma, max_layers=1)
        draft = report["drafters"]["vanilla-1L"]
        rows.append({"block_size": gamma, "draft_ms": draft["draft_ms"], "verify_ms": report["verify_ms"],
                     "ratio": draft["ratio_to_verify"]})
    return rows


def _speed(args: argparse.Namespace, loaded, paths: list[str], specs: dict) -> dict:
    from dspark.bench import run_speed_bench

    code = next((p for p in paths if "humaneval" in p or "mbpp" in p), paths[0])
    extra = [f"{name}={spec}" for name, spec in specs.items() if spec not in ("none", "ngram")]
    bench_args = argparse.Namespace(target=loaded, dataset=code, num_prompts=args.speed_prompts,
                                    max_new_tokens=args.max_new_tokens, block_size=None, prompt_lookup_num_tokens=10,
                                    drafter=extra, scheduler="dspark", json=True, dtype=args.dtype, peer=None,
                                    compile=False)
    return run_speed_bench(bench_args)
