"""`dspark eval`: acceptance of a drafter on real rollouts, per dataset and per domain (the metrics:
dspark.eval.evaluate), on prompt files and on the prompts a `dspark train` run held out of its corpus.

It sits above dspark.train, whose corpus split it reuses, so dspark.eval stays free of training code.
"""

import argparse
import json
import sys
from pathlib import Path

from dspark.cli_args import add_dtype_arg
from dspark.errors import DsparkError
from dspark.eval.datasets import load_dataset_prompts
from dspark.eval.evaluate import ThresholdDrafter, evaluation_report
from dspark.eval.rollout import run_rollouts
from dspark.train.heldout import add_prompt_args, corpus_rollouts


def write_plots(report: dict, plot_dir: str | Path) -> list[str]:
    """Per-position acceptance bars and accepted-length histograms, per dataset and overall."""
    from dspark.plots import plot_accepted_histogram, plot_position_acceptance

    series = dict(report["datasets"])
    if len(series) > 1:
        series["all"] = report
    plot_dir = Path(plot_dir)
    return [
        str(plot_position_acceptance({n: r["position_acceptance"] for n, r in series.items()},
                                     plot_dir / "position_acceptance.png")),
        str(plot_accepted_histogram({n: r["accepted_length_histogram"] for n, r in series.items()},
                                    plot_dir / "accepted_length_histogram.png")),
    ]


# duplicates: same shape as `dspark calibrate`'s parser (train/calibrate.py); their shared flags are
# `add_prompt_args`, the rest differ per command — kept apart on purpose
def add_eval_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval", help="acceptance length τ and per-position acceptance of a drafter on prompt sets",
        description="Generate with speculative decoding on each dataset and report τ (overall, per dataset "
                    "and per domain), accepted-length histogram, per-position conditional acceptance, "
                    "acceptance rate and draft/verify time.",
    )
    parser.add_argument("--target", default="default", help="as for `dspark generate`")
    parser.add_argument("--drafter", default="default", help="none | ngram | default | PATH to a drafter checkpoint")
    add_prompt_args(parser, num_prompts=10,
                    dataset_help="JSONL with 'turns' or 'messages' per line; the file name picks the domain "
                                 "(repeatable)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--block-size", type=int, default=None,
                        help="most drafts verified per round (γ); default: the drafter's own, can only shrink it")
    parser.add_argument("--threshold", type=float, default=None,
                        help="static threshold: verify drafts only while their prefix survival a_k >= t")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-dir", default=None, help="write PNG plots into this directory")
    parser.add_argument("--json", action="store_true", help="print one JSON line with the results last")
    add_dtype_arg(parser)
    parser.set_defaults(handler=run_eval)


def run_eval(args: argparse.Namespace) -> dict:
    from dspark.drafters import load_drafter
    from dspark.loading import load_target, target_dtype_name
    from dspark.sampling import SamplingParams
    from dspark.scheduler import resolve_block_size

    if args.num_prompts <= 0 or args.max_new_tokens <= 0:
        raise DsparkError("--num-prompts and --max-new-tokens must be > 0")
    if args.block_size is not None and args.block_size < 0:
        raise DsparkError(f"--block-size must be >= 0, got {args.block_size}")
    sampling = SamplingParams(args.temperature)
    if not args.dataset and not args.corpus:
        raise DsparkError("give --dataset FILE (repeatable) and/or --corpus CORPUS")
    prompts = load_dataset_prompts(args.dataset, args.num_prompts)
    loaded = load_target(args.target, args.dtype)
    drafter = load_drafter(args.drafter, loaded.model)
    block_size = resolve_block_size(args.block_size, drafter_limit=drafter.max_block_size)
    if args.threshold is not None:
        drafter = ThresholdDrafter(drafter, args.threshold)
    rollouts = run_rollouts(loaded, drafter, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                            block_size=block_size, seed=args.seed)
    if args.corpus:
        rollouts += corpus_rollouts(loaded, drafter, args, sampling, block_size)
    report = {
        "command": "eval",
        "target": loaded.name,
        "dtype": target_dtype_name(loaded.model),
        "drafter": args.drafter,
        "temperature": args.temperature,
        "block_size": block_size,
        "threshold": args.threshold,
        "max_new_tokens": args.max_new_tokens,
        **evaluation_report(rollouts, block_size),
    }
    if args.plot_dir:
        report["plots"] = write_plots(report, args.plot_dir)
    _print_table(report, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report))
    return report


def _print_table(report: dict, out) -> None:
    print(f"{'group':<20}{'prompts':>8}{'rounds':>8}{'tau':>8}{'accept':>8}{'verified':>9}  per-position acceptance",
          file=out)
    rows = [*report["datasets"].items(), *(("domain:" + k, v) for k, v in report["domains"].items()),
            ("all", report)]
    for name, row in rows:
        rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.3f}"
        positions = " ".join("-" if r is None else f"{r:.2f}" for r in row["position_acceptance"])
        print(f"{name:<20}{row['num_prompts']:>8}{row['num_rounds']:>8}{row['tau']:>8.3f}{rate:>8}"
              f"{row['tokens_verified_per_round']:>9.2f}  {positions}", file=out)
    print(f"draft {report['draft_ms_per_round']:.2f} ms/round, verify {report['verify_ms_per_round']:.2f} ms/round",
          file=out)
    if report["expected_tau"] is not None:
        print(f"expected tau from the confidences {report['expected_tau']:.3f} (raw {report['expected_tau_raw']:.3f})"
              f" vs measured {report['tau']:.3f}", file=out)
