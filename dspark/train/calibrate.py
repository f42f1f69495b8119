"""Sequential Temperature Scaling (STS, paper section 3.2.1) of a DSpark confidence head.

c_k estimates P(draft k survives | drafts 1..k-1 survived), so the chance that the whole prefix
1..k survives is a_k = Π_{i≤k} c_i — the number the prefix scheduler multiplies into its throughput
estimate, which is why its absolute value (not just its ranking) has to be right. Confidence heads
come out overconfident; STS fixes that with one temperature per block position,
c_k = σ(z_k / T_k), fitted left to right on held-out rollouts: T_k is grid-searched to minimise the
ECE of a_k against "drafts 1..k were all accepted", with T_1..T_{k-1} already fixed. A positive
temperature never reorders the confidences of one position, so what the head ranks well stays
ranked. The temperatures go into the checkpoint's config.json and `DSparkModel.confidence` applies them.

Calibration prompts must not be the evaluation prompts: calibrating on the test set flatters the ECE
that `dspark eval` later reports.
"""

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.errors import DsparkError
from dspark.eval.metrics import expected_calibration_error, roc_auc
from dspark.eval.rollout import RoundRecord

#: log-spaced candidate temperatures; symmetric around (and including) T = 1.
TEMPERATURE_GRID: tuple[float, ...] = tuple(float(t) for t in np.geomspace(0.05, 20.0, 241))


def calibration_arrays(records: Sequence[RoundRecord], block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw confidence logits z and cumulative outcomes y, both (rounds, block_size), NaN past each
    round's last verified draft. y[r, k-1] = 1 if drafts 1..k of round r were all accepted."""
    rounds = [r for r in records if r.drafted > 0]
    logits = np.full((len(rounds), block_size), np.nan)
    outcomes = np.full((len(rounds), block_size), np.nan)
    for row, record in enumerate(rounds):
        if record.raw_logits is None:
            raise ValueError("rounds without raw confidence logits: record them from a DSpark drafter")
        n = min(record.drafted, block_size)
        logits[row, :n] = record.raw_logits[:n]
        outcomes[row, :n] = record.cumulative_outcomes[:n]
    return logits, outcomes


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Overflow-free logistic function."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def prefix_survival(logits: np.ndarray, temperatures: Sequence[float]) -> np.ndarray:
    """a_k = Π_{i≤k} σ(z_i / T_i) for logits (rounds, n), n <= len(temperatures); NaN stays NaN."""
    n = logits.shape[1]
    return np.cumprod(sigmoid(logits / np.asarray(temperatures[:n], dtype=np.float64)), axis=1)


def fit_sequential_temperatures(
    logits: np.ndarray,
    outcomes: np.ndarray,
    grid: Sequence[float] = TEMPERATURE_GRID,
    num_bins: int = 10,
    min_rounds: int = 1,
    min_positives: int = 0,
) -> list[float]:
    """STS: for k = 1..γ in order, the grid temperature minimising the ECE of a_k, T_<k fixed.

    Positions verified in fewer than `min_rounds` rounds, or where fewer than `min_positives` of
    them had drafts 1..k all accepted, keep T = 1: an ECE over a handful of (positive) samples is
    noise, and fitting it gives extreme temperatures. Among equally good temperatures the one closest
    to 1 (in log scale) wins."""
    grid_array = np.asarray(grid, dtype=np.float64)
    preference = np.argsort(np.abs(np.log(grid_array)), kind="stable")  # nearest to T = 1 first
    temperatures: list[float] = []
    for k in range(logits.shape[1]):
        rows = ~np.isnan(outcomes[:, k])
        if rows.sum() < max(min_rounds, 1) or np.nansum(outcomes[rows, k]) < min_positives:
            temperatures.append(1.0)
            continue
        prefix = prefix_survival(logits[rows, :k], temperatures)[:, -1] if k else np.ones(int(rows.sum()))
        errors = np.array([
            expected_calibration_error(prefix * sigmoid(logits[rows, k] / t), outcomes[rows, k], num_bins)
            for t in grid_array
        ])
        candidates = preference[errors[preference] <= errors.min() + 1e-12]
        temperatures.append(float(grid_array[candidates[0]]))
    return temperatures


@dataclass
class PositionReport:
    """Calibration of a_k at one block position over `count` rounds that verified draft k."""

    position: int
    count: int
    ece_before: float
    ece_after: float
    auc_before: float | None
    auc_after: float | None

    def to_dict(self) -> dict:
        def r(x):
            return None if x is None else round(x, 5)

        return {"position": self.position, "count": self.count, "ece_before": r(self.ece_before),
                "ece_after": r(self.ece_after), "auc_before": r(self.auc_before), "auc_after": r(self.auc_after)}


def position_reports(
    logits: np.ndarray, outcomes: np.ndarray, temperatures: Sequence[float], num_bins: int = 10
) -> list[PositionReport]:
    """ECE and ROC-AUC of a_k per position, raw (all T = 1) vs calibrated."""
    before = prefix_survival(logits, [1.0] * logits.shape[1])
    after = prefix_survival(logits, temperatures)
    reports = []
    for k in range(logits.shape[1]):
        rows = ~np.isnan(outcomes[:, k])
        y = outcomes[rows, k]
        reports.append(PositionReport(
            k + 1, int(rows.sum()),
            expected_calibration_error(before[rows, k], y, num_bins),
            expected_calibration_error(after[rows, k], y, num_bins),
            roc_auc(before[rows, k], y), roc_auc(after[rows, k], y),
        ))
    return reports


def pooled_report(logits: np.ndarray, outcomes: np.ndarray, temperatures: Sequence[float],
                  num_bins: int = 10) -> dict:
    """The same metrics over every (round, position) pair at once."""
    rows = ~np.isnan(outcomes)
    before = prefix_survival(logits, [1.0] * logits.shape[1])[rows]
    after = prefix_survival(logits, temperatures)[rows]
    y = outcomes[rows]
    report = {"count": int(rows.sum()),
              "ece_before": expected_calibration_error(before, y, num_bins),
              "ece_after": expected_calibration_error(after, y, num_bins),
              "auc_before": roc_auc(before, y), "auc_after": roc_auc(after, y)}
    return {k: v if v is None or isinstance(v, int) else round(v, 5) for k, v in report.items()}


def store_temperatures(checkpoint: str | Path, temperatures: Sequence[float] | None) -> None:
    """Write `calibration_temperatures` into a DSpark checkpoint's config.json (weights untouched).

    The new config is validated first and replaces the old one atomically, so an interrupted or
    invalid write never leaves a broken checkpoint."""
    from dspark.drafters.checkpoint import config_from_dict
    from dspark.drafters.files import CONFIG_FILE

    config_file = Path(checkpoint) / CONFIG_FILE
    try:
        data = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise DsparkError(f"cannot read {config_file}: {error}") from error
    data.setdefault("dspark", {})["calibration_temperatures"] = (
        None if temperatures is None else [float(t) for t in temperatures])
    config_from_dict(data, str(config_file))  # raises DrafterLoadError (one line) when invalid
    handle, staging = tempfile.mkstemp(dir=config_file.parent, prefix=".config-", suffix=".json")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps(data, indent=2) + "\n")
        os.replace(staging, config_file)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


# ---------------------------------------------------------------------------------------- CLI


def add_calibrate_parser(subparsers) -> None:
    from dspark.cli import add_dtype_arg

    parser = subparsers.add_parser(
        "calibrate", help="fit Sequential Temperature Scaling of a DSpark confidence head",
        description="Roll out held-out prompts with the drafter, fit one temperature per block position "
                    "(left to right, minimising the ECE of the prefix survival a_k) and store them in the "
                    "checkpoint's config.json. Use prompts that are NOT your evaluation prompts.",
    )
    parser.add_argument("--target", default="default", help="as for `dspark generate`")
    parser.add_argument("--drafter", required=True, help="DSpark checkpoint directory (updated in place)")
    parser.add_argument("--dataset", action="append", required=True,
                        help="held-out prompts, JSONL with 'turns' or 'messages' per line (repeatable)")
    parser.add_argument("--num-prompts", type=int, default=20, help="prompts taken from each dataset")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of the rollouts (0 = greedy); calibrate at the one you serve")
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


def run_calibrate(args: argparse.Namespace) -> dict:
    from dspark.drafters import load_drafter
    from dspark.drafters.dspark import DSparkDrafter
    from dspark.eval.datasets import load_prompts
    from dspark.eval.evaluate import EVAL_BENCHMARKS, dataset_name
    from dspark.eval.rollout import record_rounds
    from dspark.loading import dtype_name, load_target
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
    records = record_rounds(loaded, drafter, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                            block_size=gamma, seed=args.seed)
    logits, outcomes = calibration_arrays(records, gamma)
    if not len(logits):
        raise DsparkError("no round verified any draft: use more prompts or a larger --max-new-tokens")
    temperatures = fit_sequential_temperatures(logits, outcomes, num_bins=args.num_bins,
                                               min_rounds=args.min_rounds, min_positives=args.min_positives)
    positions = position_reports(logits, outcomes, temperatures, args.num_bins)
    if args.plot:
        _plot(args.plot, logits, outcomes, temperatures, args.num_bins)
    if not args.dry_run:
        store_temperatures(args.drafter, temperatures)
    result = {
        "command": "calibrate",
        "drafter": str(args.drafter),
        "target": loaded.name,
        "dtype": dtype_name(loaded.model.dtype),
        "sampling_temperature": args.temperature,
        "num_prompts": len(prompts),
        "num_rounds": int(len(logits)),
        "num_bins": args.num_bins,
        "min_rounds": args.min_rounds,
        "min_positives": args.min_positives,
        "temperatures": [round(t, 5) for t in temperatures],
        "positions": [p.to_dict() for p in positions],
        "pooled": pooled_report(logits, outcomes, temperatures, args.num_bins),
        "stored": not args.dry_run,
        "plot": args.plot,
    }
    _print_table(result, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return result


def _plot(path: str, logits: np.ndarray, outcomes: np.ndarray, temperatures: Sequence[float],
          num_bins: int) -> None:
    from dspark.eval.report import plot_reliability

    before = prefix_survival(logits, [1.0] * logits.shape[1])
    after = prefix_survival(logits, temperatures)
    panels = []
    for k in range(logits.shape[1]):
        rows = ~np.isnan(outcomes[:, k])
        if rows.any():
            panels.append((f"a_{k + 1} (T={temperatures[k]:.2f}, n={int(rows.sum())})",
                           before[rows, k], after[rows, k], outcomes[rows, k]))
    plot_reliability(panels, path, num_bins)


def _print_table(result: dict, out) -> None:
    def fmt(x):
        return "-" if x is None else f"{x:.3f}"

    print(f"{result['num_rounds']} rounds from {result['num_prompts']} prompts; "
          f"{'stored in ' + result['drafter'] if result['stored'] else 'dry run: checkpoint unchanged'}", file=out)
    print(f"{'k':>3}{'T_k':>8}{'n':>7}{'ECE raw':>9}{'ECE cal':>9}{'AUC raw':>9}{'AUC cal':>9}", file=out)
    for row, t in zip(result["positions"], result["temperatures"], strict=True):
        print(f"{row['position']:>3}{t:>8.3f}{row['count']:>7}{fmt(row['ece_before']):>9}{fmt(row['ece_after']):>9}"
              f"{fmt(row['auc_before']):>9}{fmt(row['auc_after']):>9}", file=out)
    pooled = result["pooled"]
    print(f"all{'':>8}{pooled['count']:>7}{fmt(pooled['ece_before']):>9}{fmt(pooled['ece_after']):>9}"
          f"{fmt(pooled['auc_before']):>9}{fmt(pooled['auc_after']):>9}", file=out)
