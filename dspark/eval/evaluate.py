"""Acceptance of a drafter on real rollouts, per dataset and per domain (what `dspark eval` reports).

Every prompt is generated with the real speculative loop and every round recorded (see
`dspark.eval.rollout`). Summarised: τ (accepted + 1 per round), the accepted-length histogram, the
per-position conditional acceptance of the paper's Fig. 2, the overall acceptance rate
(accepted / verified drafts), tokens verified per round, draft and verify time, and — when the
drafter has a confidence head — how well its prefix survival a_k is calibrated. Also the verify-length
and threshold sweeps of `dspark report`, replayed from recorded rounds.

A static threshold t (`dspark eval --threshold`) is the paper's static-threshold verification: a
draft is cut before the first position whose a_k falls below t, so fewer tokens are verified per round.
"""

from collections.abc import Sequence

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
from dspark.eval.rollout import DrafterWrapper, PromptRollout, RoundRecord, all_rounds
from dspark.scheduler import threshold_lengths

#: benchmark (file stem, lower case, '_' read as '-') -> domain; any other dataset counts as chat.
DOMAINS: dict[str, str] = {
    "math500": "math", "aime25": "math", "aime24": "math", "gsm8k": "math",
    "humaneval": "code", "mbpp": "code", "livecodebench": "code",
    "mt-bench": "chat", "alpaca": "chat",
}
EVAL_BENCHMARKS = frozenset(DOMAINS)
#: thresholds t of the replayed static-threshold sweep
THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(10))


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
    for record in all_rounds(rollouts):
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
    rounds = all_rounds(rollouts)
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


# ----------------------------------------------------------------------------- replayed sweeps


def verify_length_sweep(rounds: list[RoundRecord], max_length: int) -> list[dict]:
    """τ and acceptance rate had each round verified only its first ℓ drafts, ℓ = 1..max_length.
    Replayed from rounds verified at full length: at T = 0 a round's accepted prefix does not depend
    on how many drafts follow it, so min(accepted, ℓ) is what a shorter verify would have accepted."""
    rows = []
    for length in range(1, max_length + 1):
        drafted = [min(r.drafted, length) for r in rounds]
        accepted = [min(r.accepted, length) for r in rounds]
        rows.append({"verify_length": length, "tau": _round(tau(accepted)),
                     "acceptance_rate": _round(acceptance_rate(drafted, accepted))})
    return rows


def threshold_sweep(rounds: list[RoundRecord], thresholds=THRESHOLDS) -> list[dict]:
    """Tokens per round and acceptance rate under the static cut 'verify while a_k ≥ t', replayed
    from full-length rounds with confidences (paper Fig. 5)."""
    scored = [r for r in rounds if r.survival is not None]
    rows = []
    for t in thresholds:
        cuts = [next((k for k, a in enumerate(r.survival) if a < t), r.drafted) for r in scored]
        accepted = [min(r.accepted, cut) for r, cut in zip(scored, cuts, strict=True)]
        rows.append({"threshold": t, "verified_per_round": _round(np.mean(cuts)) if cuts else 0.0,
                     "tokens_per_round": _round(tau(accepted)),
                     "acceptance_rate": _round(acceptance_rate(cuts, accepted))})
    return rows
