"""`dspark calibrate`: roll out held-out prompts, fit sequential Platt scaling or Sequential Temperature
Scaling (dspark.calibration) to the confidence head's raw logits, plot the reliability and store the
calibration in the checkpoint.

Calibration prompts must not be the evaluation prompts: calibrating on the test set flatters the ECE
that `dspark eval` later reports.
"""

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np

from dspark.calibration import (
    calibration_arrays,
    fit_sequential_platt,
    fit_sequential_temperatures,
    pooled_report,
    position_reports,
    prefix_survival,
    store_calibration,
)
from dspark.cli_args import add_dtype_arg
from dspark.errors import DsparkError
from dspark.train.heldout import add_prompt_args, corpus_rollouts


def add_calibrate_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="calibrate a DSpark confidence head (sequential Platt or temperature scaling)",
        description="Roll out held-out prompts with the drafter, fit per block position, left to right, a "
                    "temperature and a bias (--method platt: likelihood of the prefix survival a_k) or a "
                    "temperature alone (--method sts: the paper's STS, minimising the ECE of a_k), and store "
                    "them in the checkpoint's config.json. Use prompts that are NOT your evaluation prompts.",
    )
    parser.add_argument("--target", default="default", help="as for `dspark generate`")
    parser.add_argument("--drafter", required=True, help="DSpark checkpoint directory (updated in place)")
    add_prompt_args(parser, num_prompts=20,
                    dataset_help="held-out prompts, JSONL with 'turns' or 'messages' per line (repeatable)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of the rollouts (0 = greedy). The fit is stored for this "
                             "temperature next to those fitted at others; requests use the set fitted nearest "
                             "their own temperature, so calibrate at each one you serve (e.g. 0 and 1)")
    parser.add_argument("--method", choices=("platt", "sts"), default="platt",
                        help="platt: c_k = σ(z_k / T_k + b_k), fitted by likelihood (moves the mean, which a "
                             "temperature cannot); sts: the paper's temperatures alone, by ECE grid search")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-bins", type=int, default=10, help="equal-width ECE bins")
    parser.add_argument("--min-rounds", type=int, default=50,
                        help="positions verified in fewer rounds keep temperature 1 (too few samples to fit)")
    parser.add_argument("--min-positives", type=int, default=20,
                        help="positions where fewer verified rounds had drafts 1..k all accepted keep temperature 1")
    parser.add_argument("--plot", default=None, help="write a reliability diagram (PNG) here")
    parser.add_argument("--dry-run", action="store_true", help="report only; leave the checkpoint unchanged")
    parser.add_argument("--json", action="store_true", help="print one JSON line with the results last")
    add_dtype_arg(parser)
    parser.set_defaults(handler=run_calibrate)


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts <= 0 or args.max_new_tokens <= 0 or args.num_bins <= 0:
        raise DsparkError("--num-prompts, --max-new-tokens and --num-bins must be > 0")
    if not args.dataset and not args.corpus:
        raise DsparkError("give --dataset FILE (repeatable) and/or --corpus CORPUS (its held-out prompts)")


def run_calibrate(args: argparse.Namespace) -> dict:
    from dspark.drafters import load_drafter
    from dspark.drafters.dspark_drafter import DSparkDrafter
    from dspark.eval.datasets import dataset_name, load_prompts
    from dspark.eval.evaluate import EVAL_BENCHMARKS
    from dspark.eval.rollout import all_rounds, run_rollouts
    from dspark.loading import load_target, target_dtype_name
    from dspark.sampling import SamplingParams

    _check_args(args)
    sampling = SamplingParams(args.temperature)
    prompts = []
    for path in args.dataset:
        name = dataset_name(path)
        if name in EVAL_BENCHMARKS:
            print(f"[dspark] warning: {path} looks like an evaluation set; calibrate on held-out prompts",
                  file=sys.stderr)
        prompts += [(name, prompt) for prompt in load_prompts(path, args.num_prompts)]
    loaded = load_target(args.target, args.dtype)
    drafter = load_drafter(args.drafter, loaded.model)
    if not isinstance(drafter, DSparkDrafter) or drafter.model.confidence_head is None:
        raise DsparkError(f"{args.drafter} is not a DSpark checkpoint with a confidence head: nothing to calibrate")
    gamma = drafter.config.block_size
    num_prompts = len(prompts)
    records = all_rounds(run_rollouts(loaded, drafter, prompts, max_new_tokens=args.max_new_tokens,
                                      sampling=sampling, block_size=gamma, seed=args.seed))
    if args.corpus:  # prompts the training run never saw, as their exact token ids
        rollouts = corpus_rollouts(loaded, drafter, args, sampling, gamma)
        records += all_rounds(rollouts)
        num_prompts += len(rollouts)
    logits, outcomes = calibration_arrays(records, gamma)
    if not len(logits):
        raise DsparkError("no round verified any draft: use more prompts or a larger --max-new-tokens")
    biases = None
    if args.method == "platt":
        temperatures, biases = fit_sequential_platt(logits, outcomes, min_rounds=args.min_rounds,
                                                    min_positives=args.min_positives)
    else:
        temperatures = fit_sequential_temperatures(logits, outcomes, num_bins=args.num_bins,
                                                   min_rounds=args.min_rounds, min_positives=args.min_positives)
    positions = position_reports(logits, outcomes, temperatures, args.num_bins, biases)
    if args.plot:
        plot_calibration(args.plot, logits, outcomes, temperatures, args.num_bins, biases)
    if not args.dry_run:
        store_calibration(args.drafter, temperatures, sampling.temperature, biases)
    result = {
        "command": "calibrate",
        "drafter": str(args.drafter),
        "target": loaded.name,
        "dtype": target_dtype_name(loaded.model),
        "sampling_temperature": args.temperature,
        "num_prompts": num_prompts,
        "corpus": args.corpus,
        "num_rounds": int(len(logits)),
        "num_bins": args.num_bins,
        "min_rounds": args.min_rounds,
        "min_positives": args.min_positives,
        "method": args.method,
        "temperatures": [round(t, 5) for t in temperatures],
        "biases": None if biases is None else [round(b, 5) for b in biases],
        "positions": [p.to_dict() for p in positions],
        "pooled": pooled_report(logits, outcomes, temperatures, args.num_bins, biases),
        "stored": not args.dry_run,
        "plot": args.plot,
    }
    _print_table(result, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return result


def plot_calibration(path: str, logits: np.ndarray, outcomes: np.ndarray, temperatures: Sequence[float],
                     num_bins: int, biases: Sequence[float] | None = None) -> None:
    """Reliability diagrams of a_1..a_γ, raw (all T = 1) and calibrated (also for `dspark report`)."""
    from dspark.plots import plot_reliability

    before = prefix_survival(logits, [1.0] * logits.shape[1])
    after = prefix_survival(logits, temperatures, biases)
    panels = []
    for k in range(logits.shape[1]):
        rows = ~np.isnan(outcomes[:, k])
        if rows.any():
            bias = "" if biases is None else f", b={biases[k]:+.2f}"
            panels.append((f"a_{k + 1} (T={temperatures[k]:.2f}{bias}, n={int(rows.sum())})",
                           before[rows, k], after[rows, k], outcomes[rows, k]))
    plot_reliability(panels, path, num_bins)


def _print_table(result: dict, out) -> None:
    def fmt(x):
        return "-" if x is None else f"{x:.3f}"

    print(f"{result['num_rounds']} rounds from {result['num_prompts']} prompts; "
          f"{'stored in ' + result['drafter'] if result['stored'] else 'dry run: checkpoint unchanged'}", file=out)
    print(f"{'k':>3}{'T_k':>8}{'b_k':>8}{'n':>7}{'ECE raw':>9}{'ECE cal':>9}{'AUC raw':>9}{'AUC cal':>9}"
          f"{'mean raw':>9}{'mean cal':>9}{'observed':>9}", file=out)
    biases = result["biases"] or [0.0] * len(result["temperatures"])
    for row, t, b in zip(result["positions"], result["temperatures"], biases, strict=True):
        print(f"{row['position']:>3}{t:>8.3f}{b:>8.3f}{row['count']:>7}{fmt(row['ece_before']):>9}"
              f"{fmt(row['ece_after']):>9}{fmt(row['auc_before']):>9}{fmt(row['auc_after']):>9}"
              f"{fmt(row['mean_before']):>9}{fmt(row['mean_after']):>9}{fmt(row['mean_observed']):>9}", file=out)
    pooled = result["pooled"]
    print(f"all{'':>16}{pooled['count']:>7}{fmt(pooled['ece_before']):>9}{fmt(pooled['ece_after']):>9}"
          f"{fmt(pooled['auc_before']):>9}{fmt(pooled['auc_after']):>9}", file=out)
