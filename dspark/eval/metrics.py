"""Pure metrics over recorded speculative rounds and over confidence predictions.

A round is summarised by two numbers: how many drafts were verified (`drafted`) and how many of them
the target accepted (`accepted`, a prefix). Everything the paper reports at batch size 1 follows:

- τ, the acceptance length: accepted + 1 (the recovered or bonus token), averaged over rounds;
- the accepted-length histogram;
- the per-position *conditional* acceptance of Fig. 2: position k counts only in rounds where drafts
  1..k-1 were all accepted, so a position is not blamed for an earlier rejection;
- the overall acceptance rate, accepted / drafted.

For the confidence head (Fig. 6): expected calibration error over equal-width bins and ROC-AUC from
ranks (ties get their average rank, i.e. count one half), so no scikit-learn is needed.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def tau(accepted: Sequence[int]) -> float:
    """Mean tokens emitted per round: accepted drafts + 1. 0.0 when there are no rounds."""
    return float(np.mean(accepted)) + 1.0 if len(accepted) else 0.0


def expected_tau(survivals: Sequence[Sequence[float]]) -> float | None:
    """Mean over rounds of 1 + Σ_k a_k, the acceptance length the confidences predict (a_k = P(drafts
    1..k all survive)); compared with the measured τ it says whether the scheduler's inputs are honest.
    None when no round has confidences."""
    if not survivals:
        return None
    return float(np.mean([1.0 + float(np.sum(a)) for a in survivals]))


def accepted_length_histogram(accepted: Sequence[int], max_length: int | None = None) -> list[int]:
    """counts[n] = number of rounds that accepted exactly n drafts, n = 0..max_length."""
    top = max(accepted, default=0) if max_length is None else max_length
    counts = [0] * (top + 1)
    for n in accepted:
        if not 0 <= n <= top:
            raise ValueError(f"accepted length {n} outside 0..{top}")
        counts[n] += 1
    return counts


@dataclass
class PositionAcceptance:
    """attempts[k-1]: rounds where draft k was verified after drafts 1..k-1 were accepted;
    accepts[k-1]: how many of those accepted draft k as well."""

    attempts: list[int]
    accepts: list[int]

    @property
    def rates(self) -> list[float | None]:
        """Conditional acceptance per position; None where the position was never reached."""
        return [a / n if n else None for a, n in zip(self.accepts, self.attempts, strict=True)]


def conditional_acceptance(drafted: Sequence[int], accepted: Sequence[int]) -> PositionAcceptance:
    """Per-position conditional acceptance (paper Fig. 2) over rounds (drafted_i, accepted_i)."""
    if len(drafted) != len(accepted):
        raise ValueError(f"{len(drafted)} drafted counts for {len(accepted)} accepted counts")
    length = max(drafted, default=0)
    attempts, accepts = [0] * length, [0] * length
    for num_drafted, num_accepted in zip(drafted, accepted, strict=True):
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafts")
        for k in range(min(num_drafted, num_accepted + 1)):  # reached: every earlier draft accepted
            attempts[k] += 1
            accepts[k] += int(k < num_accepted)
    return PositionAcceptance(attempts, accepts)


def acceptance_rate(drafted: Sequence[int], accepted: Sequence[int]) -> float | None:
    """Accepted drafts / verified drafts; None when nothing was drafted."""
    total = sum(drafted)
    return sum(accepted) / total if total else None


def _as_arrays(probs, outcomes) -> tuple[np.ndarray, np.ndarray]:
    probs = np.asarray(probs, dtype=np.float64).ravel()
    outcomes = np.asarray(outcomes, dtype=np.float64).ravel()
    if probs.shape != outcomes.shape:
        raise ValueError(f"{probs.size} predictions for {outcomes.size} outcomes")
    return probs, outcomes


def _bin_index(probs: np.ndarray, num_bins: int) -> np.ndarray:
    """Equal-width bins on [0, 1]; 1.0 falls in the last bin."""
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    return np.clip((probs * num_bins).astype(np.int64), 0, num_bins - 1)


@dataclass
class ReliabilityBins:
    """Per bin: number of predictions, their mean, and the observed frequency of the outcome
    (mean/frequency are NaN for empty bins)."""

    edges: np.ndarray
    counts: np.ndarray
    mean_predicted: np.ndarray
    observed: np.ndarray


def reliability_bins(probs, outcomes, num_bins: int = 10) -> ReliabilityBins:
    probs, outcomes = _as_arrays(probs, outcomes)
    index = _bin_index(probs, num_bins)
    counts = np.bincount(index, minlength=num_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_predicted = np.bincount(index, probs, minlength=num_bins) / counts
        observed = np.bincount(index, outcomes, minlength=num_bins) / counts
    return ReliabilityBins(np.linspace(0.0, 1.0, num_bins + 1), counts.astype(np.int64), mean_predicted, observed)


def expected_calibration_error(probs, outcomes, num_bins: int = 10) -> float:
    """ECE = Σ_b (n_b / n) · |mean prediction in b − outcome frequency in b| over equal-width bins.

    0.0 for no predictions (nothing is miscalibrated)."""
    bins = reliability_bins(probs, outcomes, num_bins)
    total = bins.counts.sum()
    if not total:
        return 0.0
    filled = bins.counts > 0
    gaps = np.abs(bins.mean_predicted[filled] - bins.observed[filled])
    return float((bins.counts[filled] * gaps).sum() / total)


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks; tied values all get the mean of the ranks they span."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    ranks = np.empty(len(values), dtype=np.float64)
    start = 0
    while start < len(values):
        end = start
        while end + 1 < len(values) and sorted_values[end + 1] == sorted_values[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1  # mean of ranks start+1..end+1
        start = end + 1
    return ranks


def roc_auc(scores, outcomes) -> float | None:
    """Area under the ROC curve = P(score of a random positive > score of a random negative), ties
    counting one half (Mann–Whitney U from average ranks). None unless both classes occur."""
    scores, outcomes = _as_arrays(scores, outcomes)
    positive = outcomes > 0.5
    num_pos, num_neg = int(positive.sum()), int((~positive).sum())
    if not num_pos or not num_neg:
        return None
    rank_sum = average_ranks(scores)[positive].sum()
    return float((rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))
