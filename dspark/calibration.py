"""Calibrating a DSpark confidence head: Sequential Temperature Scaling (STS, paper section 3.2.1)
and its two-parameter extension, sequential Platt scaling.

c_k estimates P(draft k survives | drafts 1..k-1 survived), so the chance that the whole prefix
1..k survives is a_k = Π_{i≤k} c_i — the number the prefix scheduler multiplies into its throughput
estimate, which is why its absolute value (not just its ranking) has to be right. Confidence heads
come out overconfident; STS fixes that with one temperature per block position,
c_k = σ(z_k / T_k), fitted left to right on held-out rollouts: T_k is grid-searched to minimise the
ECE of a_k against "drafts 1..k were all accepted", with T_1..T_{k-1} already fixed. A positive
temperature never reorders the confidences of one position, so what the head ranks well stays
ranked. A temperature cannot move a head that is off on average, though, so `fit_sequential_platt`
adds a bias per position, c_k = σ(z_k / T_k + b_k), fitted by likelihood in the same left-to-right
order (`dspark calibrate --method platt`, the default). The temperatures (and biases) go into the
checkpoint's config.json, one set per sampling temperature they
were fitted at (a sampled draft survives less often than a greedy one with the same logit), and
`DSparkModel.confidence` applies the set fitted nearest each request's temperature.

Here: the fits, their metrics and storing them. `dspark calibrate` (dspark.train.calibrate)
rolls out the prompts and plots; `dspark report` measures stored temperatures on evaluation rounds.
"""

import json
import os
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


def prefix_survival(logits: np.ndarray, temperatures: Sequence[float],
                    biases: Sequence[float] | None = None) -> np.ndarray:
    """a_k = Π_{i≤k} σ(z_i / T_i + b_i) for logits (rounds, n), n <= len(temperatures); NaN stays NaN."""
    n = logits.shape[1]
    shift = 0.0 if biases is None else np.asarray(biases[:n], dtype=np.float64)
    return np.cumprod(sigmoid(logits / np.asarray(temperatures[:n], dtype=np.float64) + shift), axis=1)


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


def fit_sequential_platt(
    logits: np.ndarray,
    outcomes: np.ndarray,
    min_rounds: int = 1,
    min_positives: int = 0,
) -> tuple[list[float], list[float]]:
    """Sequential Platt scaling: c_k = σ(z_k / T_k + b_k), (T_k, b_k) fitted for k = 1..γ in order by
    maximum likelihood of "drafts 1..k all survived" under a_k = a_{k-1} · c_k, earlier positions fixed.

    Why a bias: a temperature only sharpens or softens the head's logits around 0; when the head is
    off on average (it learned acceptance on training data that is easier or harder than what it
    serves) no temperature moves the mean, and the scheduler's expected τ stays off (docs/training.md,
    run 8: +15% at T = 1 with STS). The likelihood, unlike an ECE over bins, is smooth, so two
    parameters per position fit by L-BFGS in well under a second. T_k > 0 keeps each position's ranking. The
    same guards as `fit_sequential_temperatures` leave thinly sampled positions at (1, 0)."""
    temperatures: list[float] = []
    biases: list[float] = []
    for k in range(logits.shape[1]):
        rows = ~np.isnan(outcomes[:, k])
        if rows.sum() < max(min_rounds, 1) or np.nansum(outcomes[rows, k]) < min_positives:
            temperatures.append(1.0)
            biases.append(0.0)
            continue
        prefix = prefix_survival(logits[rows, :k], temperatures, biases)[:, -1] if k else np.ones(int(rows.sum()))
        temperature, bias = _fit_platt_position(logits[rows, k], outcomes[rows, k], prefix)
        temperatures.append(temperature)
        biases.append(bias)
    return temperatures, biases


def _fit_platt_position(z: np.ndarray, y: np.ndarray, prefix: np.ndarray) -> tuple[float, float]:
    """(T, b) maximising the likelihood of outcomes y under a = prefix · σ(z / T + b); (1, 0) if it diverges."""
    import torch

    z_t, y_t = torch.from_numpy(z.astype(np.float64)), torch.from_numpy(y.astype(np.float64))
    log_prefix = torch.from_numpy(np.log(np.clip(prefix, 1e-12, 1.0)).astype(np.float64))
    params = torch.zeros(2, dtype=torch.float64, requires_grad=True)  # log(1 / T), b
    optimizer = torch.optim.LBFGS([params], lr=1.0, max_iter=200, tolerance_grad=1e-10, tolerance_change=1e-14,
                                  line_search_fn="strong_wolfe")

    def negative_log_likelihood() -> torch.Tensor:
        optimizer.zero_grad()
        log_a = log_prefix + torch.nn.functional.logsigmoid(z_t * params[0].exp() + params[1])
        log_not_a = torch.log1p(-log_a.exp().clamp(max=1 - 1e-12))
        value = -(y_t * log_a + (1 - y_t) * log_not_a).mean()
        value.backward()
        return value

    optimizer.step(negative_log_likelihood)
    log_inverse_t, bias = params.detach().tolist()
    if not (np.isfinite(log_inverse_t) and np.isfinite(bias)):
        return 1.0, 0.0
    return float(np.exp(-log_inverse_t)), float(bias)


@dataclass
class PositionReport:
    """Calibration of a_k at one block position over `count` rounds that verified draft k."""

    position: int
    count: int
    ece_before: float
    ece_after: float
    auc_before: float | None
    auc_after: float | None
    #: mean a_k raw / calibrated and the observed rate of "1..k all survived": what expected τ sums
    mean_before: float = float("nan")
    mean_after: float = float("nan")
    mean_observed: float = float("nan")

    def to_dict(self) -> dict:
        def r(x):
            return None if x is None else round(x, 5)

        return {"position": self.position, "count": self.count, "ece_before": r(self.ece_before),
                "ece_after": r(self.ece_after), "auc_before": r(self.auc_before), "auc_after": r(self.auc_after),
                "mean_before": r(self.mean_before), "mean_after": r(self.mean_after),
                "mean_observed": r(self.mean_observed)}


def position_reports(
    logits: np.ndarray, outcomes: np.ndarray, temperatures: Sequence[float], num_bins: int = 10,
    biases: Sequence[float] | None = None,
) -> list[PositionReport]:
    """ECE, ROC-AUC and mean of a_k per position, raw (all T = 1) vs calibrated."""
    before = prefix_survival(logits, [1.0] * logits.shape[1])
    after = prefix_survival(logits, temperatures, biases)
    reports = []
    for k in range(logits.shape[1]):
        rows = ~np.isnan(outcomes[:, k])
        y = outcomes[rows, k]
        reports.append(PositionReport(
            k + 1, int(rows.sum()),
            expected_calibration_error(before[rows, k], y, num_bins),
            expected_calibration_error(after[rows, k], y, num_bins),
            roc_auc(before[rows, k], y), roc_auc(after[rows, k], y),
            _mean(before[rows, k]), _mean(after[rows, k]), _mean(y),
        ))
    return reports


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if len(x) else float("nan")


def pooled_report(logits: np.ndarray, outcomes: np.ndarray, temperatures: Sequence[float],
                  num_bins: int = 10, biases: Sequence[float] | None = None) -> dict:
    """The same metrics over every (round, position) pair at once."""
    rows = ~np.isnan(outcomes)
    before = prefix_survival(logits, [1.0] * logits.shape[1])[rows]
    after = prefix_survival(logits, temperatures, biases)[rows]
    y = outcomes[rows]
    report = {"count": int(rows.sum()),
              "ece_before": expected_calibration_error(before, y, num_bins),
              "ece_after": expected_calibration_error(after, y, num_bins),
              "auc_before": roc_auc(before, y), "auc_after": roc_auc(after, y)}
    return {k: v if v is None or isinstance(v, int) else round(v, 5) for k, v in report.items()}


def store_calibration(checkpoint: str | Path, temperatures: Sequence[float] | None,
                      sampling_temperature: float | None = None, biases: Sequence[float] | None = None) -> None:
    """Write a calibration (STS temperatures, with Platt biases or without) into a DSpark checkpoint's
    config.json (weights untouched).

    With `sampling_temperature` (0 = greedy) the set goes into `calibration_by_sampling` (its biases
    into `calibration_biases_by_sampling`) under that temperature, replacing only a set fitted at the
    same one, and `calibration_temperatures` / `calibration_biases` (what requests without a nearer set
    use, and what other loaders read) become the set fitted nearest greedy. Without it the set becomes
    the fallback alone; None clears every set. The new config is validated first and replaces the old
    one atomically, so an interrupted or invalid write never leaves a broken checkpoint."""
    from dspark.drafters.checkpoint import config_from_dict
    from dspark.drafters.files import CONFIG_FILE

    config_file = Path(checkpoint) / CONFIG_FILE
    try:
        data = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise DsparkError(f"cannot read {config_file}: {error}") from error
    extras = data.setdefault("dspark", {})
    new = None if temperatures is None else [float(t) for t in temperatures]
    new_biases = None if biases is None else [float(b) for b in biases]
    if new is None and new_biases is not None:
        raise ValueError("biases need temperatures next to them")
    if sampling_temperature is None:
        extras["calibration_temperatures"] = new
        _set_or_drop(extras, "calibration_biases", new_biases)
        if new is None:
            extras.pop("calibration_by_sampling", None)
            extras.pop("calibration_biases_by_sampling", None)
    else:
        if new is None:
            raise ValueError("give the temperatures to store at a sampling temperature")
        try:
            table = {float(t): v for t, v in (extras.get("calibration_by_sampling") or {}).items()}
            bias_table = {float(t): v for t, v in (extras.get("calibration_biases_by_sampling") or {}).items()}
        except (TypeError, ValueError, AttributeError) as error:
            raise DsparkError(f"{config_file}: unreadable dspark calibration tables: {error}") from error
        key = float(sampling_temperature)
        table[key] = new
        bias_table.pop(key, None)
        if new_biases is not None:
            bias_table[key] = new_biases
        extras["calibration_by_sampling"] = {f"{t:g}": table[t] for t in sorted(table)}
        _set_or_drop(extras, "calibration_biases_by_sampling",
                     {f"{t:g}": bias_table[t] for t in sorted(bias_table)} or None)
        extras["calibration_temperatures"] = table[min(table)]
        _set_or_drop(extras, "calibration_biases", bias_table.get(min(table)))
    config_from_dict(data, str(config_file))  # raises DrafterLoadError (one line) when invalid
    handle, staging = tempfile.mkstemp(dir=config_file.parent, prefix=".config-", suffix=".json")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps(data, indent=2) + "\n")
        os.chmod(staging, config_file.stat().st_mode & 0o777)  # mkstemp makes it 0600: keep the config's mode
        os.replace(staging, config_file)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def _set_or_drop(extras: dict, key: str, value) -> None:
    """Biases are written only where fitted, so a temperature-only config stays as other loaders know it."""
    if value is None:
        extras.pop(key, None)
    else:
        extras[key] = value
