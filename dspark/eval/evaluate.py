"""`dspark eval`: acceptance of a drafter on real rollouts, per dataset and per domain.

Every prompt is generated with the real speculative loop and every round recorded (see
`dspark.eval.rollout`). Reported: τ (accepted + 1 per round), the accepted-length histogram, the
per-position conditional acceptance of the paper's Fig. 2, the overall acceptance rate
(accepted / verified drafts), tokens verified per round, draft and verify time, and — when the
drafter has a confidence head — how well its prefix survival a_k is calibrated.

`--threshold t` is the paper's static-threshold verification: a draft is cut before the first
position whose a_k falls below t, so fewer tokens are verified per round.
"""

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dspark.drafters.base import Draft, Drafter
from dspark.errors import DsparkError
from dspark.eval.metrics import (
    acceptance_rate,
    accepted_length_histogram,
    conditional_acceptance,
    expected_calibration_error,
    expected_tau,
    roc_auc,
    tau,
)
from dspark.eval.rollout import DrafterWrapper, PromptRollout
from dspark.scheduler import threshold_lengths

#: benchmark (file stem, lower case, '_' read as '-') -> domain; any other dataset counts as chat.
DOMAINS: dict[str, str] = {
    "math500": "math", "aime25": "math", "aime24": "math", "gsm8k": "math",
    "humaneval": "code", "mbpp": "code", "livecodebench": "code",
    "mt-bench": "chat", "alpaca": "chat",
}
EVAL_BENCHMARKS = frozenset(DOMAINS)


def dataset_name(path: str | Path) -> str:
    """Benchmark name of a prompt file: its stem, lower case, with '_' read as '-'."""
    return Path(path).stem.lower().replace("_", "-")


def domain_of(name: str) -> str:
    return DOMAINS.get(name, "chat")


# ------------------------------------------------------------------------- static threshold


def cut_at_threshold(draft: Draft, threshold: float) -> Draft:
    """The longest prefix whose estimated survival a_k = Π_{i≤k} c_i stays >= threshold."""
    survival = draft.survival
    if survival is None:
        raise DsparkError("--threshold needs a drafter with a confidence head")
    return draft.truncate(threshold_lengths([survival.tolist()], threshold)[0])


class ThresholdDrafter(DrafterWrapper):
    """Static-threshold verification: each round verifies only the drafts the confidence head expects
    to survive with probability >= threshold. Cutting a draft never affects losslessness."""

    def __init__(self, inner: Drafter, threshold: float) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise DsparkError(f"threshold must be in [0, 1], got {threshold}")
        super().__init__(inner)
        self.threshold = threshold

    def propose(self, state, context, num_tokens, sampling, generator) -> Draft:
        return cut_at_threshold(self.inner.propose(state, context, num_tokens, sampling, generator), self.threshold)


# ---------------------------------------------------------------------------------- summaries


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def _pad(values: list, length: int, fill) -> list:
    return values + [fill] * (length - len(values))


def confidence_summary(rollouts: Sequence[PromptRollout], num_bins: int = 10) -> dict | None:
    """ECE / ROC-AUC of the (calibrated) a_k against 'drafts 1..k all accepted', pooled over positions."""
    predicted, outcomes = [], []
    for rollout in rollouts:
        for record in rollout.rounds:
            if record.survival is not None:
                predicted += record.survival
                outcomes += record.cumulative_outcomes
    if not predicted:
        return None
    return {"count": len(predicted), "ece": _round(expected_calibration_error(predicted, outcomes, num_bins)),
            "auc": _round(roc_auc(predicted, outcomes)), "mean_predicted": _round(np.mean(predicted)),
            "mean_observed": _round(np.mean(outcomes))}


def summarise(rollouts: Sequence[PromptRollout], block_size: int) -> dict:
    """Every metric of one group of rollouts (a dataset, a domain, or all)."""
    rounds = [record for rollout in rollouts for record in rollout.rounds]
    drafted = [r.drafted for r in rounds]
    accepted = [r.accepted for r in rounds]
    length = max([block_size, *drafted])
    positions = conditional_acceptance(drafted, accepted)
    stats = [rollout.stats for rollout in rollouts]
    draft_time, verify_time = sum(s.draft_time for s in stats), sum(s.verify_time for s in stats)
    total_time = sum(s.total_time for s in stats)
    generated = sum(s.num_generated for s in stats)
    per_round_ms = 1000 / len(rounds) if rounds else 0.0
    return {
        "num_prompts": len(rollouts),
        "num_rounds": len(rounds),
        "num_generated": generated,
        "tau": _round(tau(accepted)),
        "acceptance_rate": _round(acceptance_rate(drafted, accepted)),
        "tokens_verified_per_round": _round(np.mean(drafted) if drafted else 0.0),
        "accepted_length_histogram": accepted_length_histogram(accepted, length),
        "position_acceptance": _pad([_round(r) for r in positions.rates], length, None),
        "position_attempts": _pad(positions.attempts, length, 0),
        "confidence": confidence_summary(rollouts),
        "expected_tau": _round(expected_tau([r.survival for r in rounds if r.survival is not None])),
        "expected_tau_raw": _round(expected_tau([r.raw_survival for r in rounds if r.raw_survival is not None])),
        "time_s": {"total": _round(total_time), "prefill": _round(sum(s.prefill_time for s in stats)),
                   "draft": _round(draft_time), "verify": _round(verify_time)},
        "draft_ms_per_round": _round(draft_time * per_round_ms, 3),
        "verify_ms_per_round": _round(verify_time * per_round_ms, 3),
        "tokens_per_s": _round(generated / total_time if total_time else 0.0, 3),
    }


def evaluation_report(rollouts: Sequence[PromptRollout], block_size: int) -> dict:
    """Overall metrics plus `datasets.{name}` and `domains.{math,code,chat}` breakdowns."""
    datasets = list(dict.fromkeys(r.dataset for r in rollouts))
    domains = list(dict.fromkeys(domain_of(name) for name in datasets))
    return {
        **summarise(rollouts, block_size),
        "datasets": {name: summarise([r for r in rollouts if r.dataset == name], block_size) for name in datasets},
        "domains": {domain: summarise([r for r in rollouts if domain_of(r.dataset) == domain], block_size)
                    for domain in domains},
    }


def write_plots(report: dict, plot_dir: str | Path) -> list[str]:
    """Per-position acceptance bars and accepted-length histograms, per dataset and overall."""
    from dspark.eval.report import plot_accepted_histogram, plot_position_acceptance

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


# ---------------------------------------------------------------------------------------- CLI


def add_eval_parser(subparsers) -> None:
    from dspark.cli import add_dtype_arg

    parser = subparsers.add_parser(
        "eval", help="acceptance length τ and per-position acceptance of a drafter on prompt sets",
        description="Generate with speculative decoding on each dataset and report τ (overall, per dataset "
                    "and per domain), accepted-length histogram, per-position conditional acceptance, "
                    "acceptance rate and draft/verify time.",
    )
    parser.add_argument("--target", default="default", help="as for `dspark generate`")
    parser.add_argument("--drafter", default="default", help="none | ngram | default | PATH to a drafter checkpoint")
    parser.add_argument("--dataset", action="append", default=[],
                        help="JSONL with 'turns' or 'messages' per line; the file name picks the domain (repeatable)")
    parser.add_argument("--corpus", default=None,
                        help="roll out the prompts a `dspark train` run held out of this corpus (exact token ids)")
    parser.add_argument("--heldout-fraction", type=float, default=0.01, help="as the training run's")
    parser.add_argument("--split-seed", type=int, default=0, help="the training run's seed")
    parser.add_argument("--max-len", type=int, default=1024, help="the feature cache's max_len")
    parser.add_argument("--num-prompts", type=int, default=10, help="prompts taken from each dataset")
    parser.add_argument("--max-new-tokens", type=int, default=256)
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


def _load_dataset_prompts(paths: Sequence[str], num_prompts: int) -> list[tuple[str, str]]:
    from dspark.eval.datasets import load_prompts

    prompts, seen = [], {}
    for path in paths:
        name = dataset_name(path)
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name}#{seen[name]}"  # same stem twice: keep both apart
        prompts += [(label, prompt) for prompt in load_prompts(path, num_prompts)]
    return prompts


def corpus_rollouts(loaded, drafter, args: argparse.Namespace, sampling, block_size: int) -> list:
    """Rollouts of the held-out corpus prompts (their exact prompt token ids), as dataset 'heldout':
    the same prompts whose teacher-forced τ the trainer logs, so the two can be compared."""
    import torch

    from dspark.eval.rollout import rollout_prompt
    from dspark.train.cached_data import heldout_samples
    from dspark.train.corpus import load_corpus

    corpus = load_corpus(args.corpus)
    indices = heldout_samples(corpus, args.max_len, args.heldout_fraction, args.split_seed)[: args.num_prompts]
    return [rollout_prompt(loaded, drafter, torch.from_numpy(corpus.prompt_ids(i).astype("int64")),
                           max_new_tokens=args.max_new_tokens, sampling=sampling, block_size=block_size,
                           seed=args.seed + n, dataset="heldout") for n, i in enumerate(indices)]


def run_eval(args: argparse.Namespace) -> dict:
    from dspark.api import effective_block_size
    from dspark.drafters import load_drafter
    from dspark.eval.rollout import run_rollouts
    from dspark.loading import dtype_name, load_target
    from dspark.sampling import SamplingParams

    if args.num_prompts <= 0 or args.max_new_tokens <= 0:
        raise DsparkError("--num-prompts and --max-new-tokens must be > 0")
    if args.block_size is not None and args.block_size < 0:
        raise DsparkError(f"--block-size must be >= 0, got {args.block_size}")
    sampling = SamplingParams(args.temperature)
    if not args.dataset and not args.corpus:
        raise DsparkError("give --dataset FILE (repeatable) and/or --corpus CORPUS")
    prompts = _load_dataset_prompts(args.dataset, args.num_prompts)
    loaded = load_target(args.target, args.dtype)
    drafter = load_drafter(args.drafter, loaded.model)
    block_size = effective_block_size(drafter, args.block_size)
    if args.threshold is not None:
        drafter = ThresholdDrafter(drafter, args.threshold)
    rollouts = run_rollouts(loaded, drafter, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                            block_size=block_size, seed=args.seed)
    if args.corpus:
        rollouts += corpus_rollouts(loaded, drafter, args, sampling, block_size)
    report = {
        "command": "eval",
        "target": loaded.name,
        "dtype": dtype_name(loaded.model.dtype),
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
