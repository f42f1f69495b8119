"""How many draft tokens each request sends to the target: the hardware-aware prefix scheduler.

A round verifies, for every active request r, a prefix of ℓ_r of its γ_r drafts. Each verified
draft costs a token in the target's forward (B = Σ_r (1 + ℓ_r) tokens) but only pays off if it
survives; the confidence head estimates that chance as the prefix survival a_{r,j} = Π_{i≤j} c_{r,i}.
The expected token throughput of a round is Θ = τ·SPS(B), with τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}) the
expected tokens emitted and SPS(B) the target's steps per second at B tokens per forward (profiled
once, `SPSTable`).

γ_r itself, the drafts a request is asked for, is capped in one place: `resolve_block_size`.

Schedulers here are pure functions of the survival lists, so they can be tested without a model:

- `fixed_lengths`: verify min(n, γ_r) drafts (the usual speculative decoding);
- `threshold_lengths`: the static confidence threshold of prior work (longest prefix with a ≥ t);
- `dspark_lengths`: paper Algorithm 1 — greedy admission in order of a, stopping at the first
  admission that does not improve Θ. The early stop is what keeps sampling lossless: admitting
  draft k is decided from a_{r,≤k}, which depend on x_{r,<k} only, never on x_{r,k} itself;
- `retrospective_lengths`: the same path without the early stop (the best prefix of the whole
  path). NOT lossless (paper appendix A: a_{r,k+1} depends on x_{r,k}, so whether x_{r,k} is
  verified would depend on its own value); kept as the negative control of the tests;
- `async_plan`: before anything is drafted, dspark-async asks it which requests should draft at all,
  from survival at least two rounds old, pricing the drafter's cost against what a draft is expected to
  bring (a request that would not be verified drafts nothing);
- `async_capacity` + `topk_lengths`: the production variant (paper §5.2). The capacity K comes
  from a search over confidences of two rounds earlier (so the step size is known in advance, and
  the search may drop the early stop: it cannot see the current drafts); the current round then
  verifies its top-K a_{r,j}, which is non-anticipating because a_{r,k+1} ≤ a_{r,k} ranks behind.

Why cutting a draft early is lossless at all: verification accepts x_k with min(1, p_k/q_k)
regardless of how many drafts follow, so verifying ℓ drafts is speculative decoding with block
size ℓ; choosing ℓ is harmless as long as the choice to verify x_k does not look at x_k.
"""

import json
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from dspark.errors import DsparkError

#: Per request r, its prefix survival a_{r,1..γ_r} (non-increasing); lists, tensors or arrays.
Survival = Sequence[Sequence[float]] | Any
#: SPS(B): target steps per second for a forward of B tokens (an `SPSTable` or any callable).
StepCurve = Callable[[int], float]


# ------------------------------------------------------------------------------- SPS table


def _isotonic_non_increasing(values: Sequence[float]) -> list[float]:
    """Least-squares non-increasing fit (pool adjacent violators): noise in a timing can go either
    way, so averaging violating neighbours is fairer than trusting the smallest measurement."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            mean, count = blocks.pop()
            previous = blocks[-1]
            total = previous[1] + count
            previous[0] = (previous[0] * previous[1] + mean * count) / total
            previous[1] = total
    return [mean for mean, count in blocks for _ in range(int(count))]


def _running_min(values: Sequence[float]) -> list[float]:
    """Pessimistic non-increasing envelope: SPS(B) = min over b ≤ B of the measured SPS(b)."""
    out, low = [], math.inf
    for value in values:
        low = min(low, float(value))
        out.append(low)
    return out


@dataclass(frozen=True)
class SPSTable:
    """SPS(B) for B = 1..max_tokens, non-increasing in B (values[B-1] = SPS(B)).

    Measured step rates are jagged (kernel tiles, noise); Algorithm 1's early stop assumes a
    smoothly decaying curve (paper §3.2.2), so measurements are smoothed to be monotone on the way
    in. Lookups beyond the profiled range are clamped to the nearest end: profile up to the largest
    forward the engine can issue, R_max·(γ+1) tokens.
    """

    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise DsparkError("an SPS table needs at least one value")
        if any(not (math.isfinite(v) and v > 0) for v in self.values):
            raise DsparkError("SPS values must be finite and positive")
        if any(b > a for a, b in zip(self.values, self.values[1:], strict=False)):
            raise DsparkError("SPS values must be non-increasing in B; build with SPSTable.from_measurements")

    @classmethod
    def from_measurements(cls, measured: Sequence[float] | Mapping[int, float],
                          method: str = "isotonic") -> "SPSTable":
        """Smooth measurements to a monotone table.

        `measured` is either SPS(1..n) in order, or {B: SPS(B)} for some B (the rest are
        interpolated linearly in between and clamped before the first measured B).
        `method`: "isotonic" (least-squares monotone fit), "running-min" (pessimistic envelope) or
        "piecewise-linear" (`piecewise_linear_times`, then isotonic).
        """
        smooth = {"isotonic": _isotonic_non_increasing, "running-min": _running_min,
                  "piecewise-linear": _isotonic_non_increasing}.get(method)
        if smooth is None:
            raise DsparkError(f"unknown SPS smoothing {method!r}; use 'isotonic', 'running-min' or 'piecewise-linear'")
        if method == "piecewise-linear":
            points = measured if isinstance(measured, Mapping) else dict(enumerate(measured, start=1))
            measured = [1.0 / t for t in piecewise_linear_times({b: 1.0 / float(v) for b, v in points.items()})]
        elif isinstance(measured, Mapping):
            measured = _interpolate(measured)
        return cls(tuple(smooth(list(measured))))

    @property
    def max_tokens(self) -> int:
        return len(self.values)

    def sps(self, num_tokens: int) -> float:
        """SPS(B), with B clamped into [1, max_tokens]."""
        return self.values[min(max(int(num_tokens), 1), len(self.values)) - 1]

    __call__ = sps

    def to_json(self) -> str:
        return json.dumps({"sps": list(self.values)})

    @classmethod
    def from_json(cls, text: str) -> "SPSTable":
        return cls(tuple(float(v) for v in json.loads(text)["sps"]))


@dataclass(frozen=True)
class RoundCost:
    """What a round costs, as the load-aware schedulers see it.

    `verify`: SPS_R(B) by number of requests R — B tokens spread over R requests cost more than the same B
    in fewer requests (every request attends over its own cache), so one curve packed into requests of γ+1
    tokens misjudges a round of 8 requests of 1–2 tokens. Between measured R the step time is interpolated
    linearly, beyond them clamped. `draft_seconds`: what drafting for n requests costs (n → seconds; 0 when
    unknown). Synchronous Algorithm 1 never needs it (the drafts are made before it runs); the async variant,
    which decides before drafting, weighs it against the tokens a draft is expected to bring.
    """

    verify: Mapping[int, StepCurve]
    draft_seconds: Mapping[int, float] = field(default_factory=dict)
    _curves: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.verify or any(int(r) < 1 for r in self.verify):
            raise DsparkError("a round cost needs step rates for at least one request count >= 1")
        if any(not (math.isfinite(s) and s >= 0) for s in self.draft_seconds.values()):
            raise DsparkError("draft seconds must be finite and >= 0")

    @classmethod
    def of(cls, sps: "StepCurve | RoundCost") -> "RoundCost":
        """A round cost as given, or one curve for every number of requests and free drafting."""
        return sps if isinstance(sps, RoundCost) else cls({1: sps})

    def curve(self, num_requests: int) -> StepCurve:
        """SPS(B) for rounds of `num_requests` requests."""
        curve = self._curves.get(num_requests)
        if curve is None:
            lower, upper, w = _bracket(sorted(self.verify), num_requests)
            if lower is None or upper is None or w == 0.0:  # a measured count, or clamped to the nearest end
                curve = self.verify[lower if upper is None else upper]
            else:
                low, high = self.verify[lower], self.verify[upper]
                curve = lambda b: 1.0 / ((1 - w) / low(b) + w / high(b))  # noqa: E731 (step times interpolate)
            self._curves[num_requests] = curve
        return curve

    def draft(self, num_requests: int) -> float:
        """Seconds to draft for `num_requests` requests (linear between measured counts, proportional beyond
        them, 0 for none)."""
        if num_requests <= 0 or not self.draft_seconds:
            return 0.0
        seconds = self.draft_seconds
        lower, upper, w = _bracket(sorted(seconds), num_requests)
        if upper is None or lower is None:  # past an end: per request, from the nearest measured count
            nearest = lower if upper is None else upper
            return seconds[nearest] * num_requests / nearest
        return (1 - w) * seconds[lower] + w * seconds[upper]

    def to_json(self) -> str:
        """The measured tables (plain callables are not serialisable: only `SPSTable`s)."""
        return json.dumps({"sps_by_requests": {str(r): list(t.values) for r, t in sorted(self.verify.items())},
                           "draft_seconds": {str(n): s for n, s in sorted(self.draft_seconds.items())}})

    @classmethod
    def from_json(cls, text: str) -> "RoundCost":
        data = json.loads(text)
        return cls({int(r): SPSTable(tuple(float(v) for v in values)) for r, values in data["sps_by_requests"].items()},
                   {int(n): float(s) for n, s in data.get("draft_seconds", {}).items()})


def _bracket(counts: list[int], n: int) -> tuple[int | None, int | None, float]:
    """(lower, upper, w): the measured counts around n in sorted `counts` (None past an end) and n's weight
    towards `upper`."""
    upper = next((c for c in counts if c >= n), None)
    lower = max((c for c in counts if c <= n), default=None)
    if lower is None or upper is None or lower == upper:
        return lower, upper, 0.0
    return lower, upper, (n - lower) / (upper - lower)


def piecewise_linear_times(times: Mapping[int, float], min_points: int = 4) -> list[float]:
    """Step times t(1..max B) from measured {B: seconds}: the least-squares continuous piecewise-linear fit, knots
    at the first measured B and its doublings (a knot is dropped when its segment would hold fewer than
    `min_points` measurements), flat before the first measured B.

    Why not isotonic on the raw cells: on a shared CPU the cells of one profile scatter by ±10% while the true
    curve rises by ~1% a token, and pooling adjacent violators then turns whole stretches flat (one profile read
    8 requests x 1 token and 8 x 2 tokens at the same 58 ms; measured apart, 51 and 70 ms), which tells the
    scheduler that those tokens are free. A line through all cells of a segment reads the slope from all of them.
    """
    sizes = sorted(int(b) for b in times)
    if not sizes or sizes[0] < 1:
        raise DsparkError("measured batch sizes must be >= 1")
    if any(not (math.isfinite(t) and t > 0) for t in times.values()):
        raise DsparkError("measured step times must be finite and positive")
    first, last = sizes[0], sizes[-1]
    knots, knot = [], 2 * first
    while knot < last:
        inside = [b for b in sizes if (knots[-1] if knots else first) <= b <= knot]
        if len(inside) >= min_points and len([b for b in sizes if b >= knot]) >= min_points:
            knots.append(knot)
        knot *= 2
    def basis(b: int) -> list[float]:  # intercept, slope from the first B, one hinge per knot
        return [1.0, b - first, *(max(0.0, b - k) for k in knots)]

    target = np.array([float(times[b]) for b in sizes])
    coefficients = np.linalg.lstsq(np.array([basis(b) for b in sizes]), target, rcond=None)[0]
    floor = 0.5 * float(target.min())  # a wild fit cannot make a step free or negative
    return [max(floor, float(coefficients @ np.array(basis(max(b, first))))) for b in range(1, last + 1)]


def _interpolate(points: Mapping[int, float]) -> list[float]:
    """SPS(1..max B) from a sparse {B: SPS(B)}: linear between measured B, flat before the first."""
    sizes = sorted(int(b) for b in points)
    if not sizes or sizes[0] < 1:
        raise DsparkError("measured batch sizes must be >= 1")
    values = []
    for b in range(1, sizes[-1] + 1):
        upper = next(s for s in sizes if s >= b)
        lower = max((s for s in sizes if s <= b), default=upper)
        if lower == upper:
            values.append(float(points[upper]))
        else:
            w = (b - lower) / (upper - lower)
            values.append((1 - w) * float(points[lower]) + w * float(points[upper]))
    return values


def time_interleaved(cells: Mapping[Any, Callable[[], Any]], repeats: int = 5, warmup: int = 1,
                     seed: int = 0) -> dict[Any, float]:
    """Median seconds of each call in `cells`, timed in passes that visit every cell once in a fresh
    (seeded) random order. A machine's slow spells then fall on every cell alike: timed one cell after
    another, a spell that hit only the 1-token cells made a whole step curve read flat (session 14), and
    a flat curve tells Algorithm 1 that every draft is free to verify."""
    keys = list(cells)
    for key in keys:
        for _ in range(warmup):
            cells[key]()
    timings: dict[Any, list[float]] = {key: [] for key in keys}
    order = random.Random(seed)
    for _ in range(repeats):
        order.shuffle(keys)
        for key in keys:
            start = time.perf_counter()
            cells[key]()
            timings[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in timings.items()}


def profile_sps(forward_fn: Callable[[int], Any], max_tokens: int, repeats: int = 5, warmup: int = 1,
                sizes: Iterable[int] | None = None, method: str = "isotonic") -> SPSTable:
    """Time `forward_fn(B)` (one target forward over B tokens) and return the smoothed table.

    `forward_fn` must block until the forward has finished (e.g. end with torch.cuda.synchronize()),
    or the timing measures only the kernel launch. The sizes are timed interleaved (`time_interleaved`)
    and the median of `repeats` timings is used, since a stray slow step (allocator, other process)
    should not set a batch size's cost. `sizes` restricts the measured B (the rest are interpolated);
    default every B in 1..max_tokens.
    """
    sizes = sorted(set(sizes) if sizes is not None else range(1, max_tokens + 1))
    seconds = time_interleaved({b: (lambda b=b: forward_fn(b)) for b in sizes}, repeats, warmup)
    return SPSTable.from_measurements({b: 1.0 / max(seconds[b], 1e-9) for b in sizes}, method)


# ------------------------------------------------------------------------------ schedulers


def _rows(survival: Survival) -> list[list[float]]:
    """Survival as lists of floats, checked: a NaN or an increasing a would silently break the sort
    (and with it the guarantee that admitted drafts form contiguous prefixes)."""
    if hasattr(survival, "tolist"):
        survival = survival.tolist()
    rows = [[float(a) for a in (row.tolist() if hasattr(row, "tolist") else row)] for row in survival]
    for row in rows:
        if any(not (0.0 <= a <= 1.0) for a in row):
            raise ValueError(f"survival probabilities must lie in [0, 1], got {row}")
        if any(b > a for a, b in zip(row, row[1:], strict=False)):
            raise ValueError(f"survival must be non-increasing along a request (a cumulative product), got {row}")
    return rows


def _admission_order(rows: list[list[float]]) -> list[tuple[float, int, int]]:
    """Every (a, r, j) with a > 0, best first. Ties go to the smaller j (then r), so that with a
    non-increasing per request a pair always comes after the rest of its request's prefix."""
    pairs = [(a, r, j) for r, row in enumerate(rows) for j, a in enumerate(row, start=1) if a > 0.0]
    pairs.sort(key=lambda pair: (-pair[0], pair[2], pair[1]))
    return pairs


def _lengths_of(order: list[tuple[float, int, int]], count: int, num_requests: int) -> list[int]:
    """ℓ_r after admitting the first `count` pairs of the admission order."""
    lengths = [0] * num_requests
    for _, r, j in order[:count]:
        lengths[r] = j  # contiguous by construction of the order
    return lengths


def _throughputs(order: list[tuple[float, int, int]], num_requests: int, sps: StepCurve):
    """Θ after admitting 0, 1, 2, ... pairs of the order, lazily (so the early stop reads no more
    of the path than it needs)."""
    batch, expected = num_requests, float(num_requests)
    yield expected * sps(batch)
    for a, _, _ in order:
        batch += 1
        expected += a
        yield expected * sps(batch)


def fixed_lengths(survival: Survival, max_verified: int) -> list[int]:
    """Verify the first min(n, γ_r) drafts of every request, whatever the confidences."""
    return [min(max_verified, len(row)) for row in _rows(survival)]


def threshold_lengths(survival: Survival, t: float) -> list[int]:
    """Static threshold: the longest prefix whose every a_k ≥ t (load-blind; paper §3.2.2)."""
    return [next((k for k, a in enumerate(row) if a < t), len(row)) for row in _rows(survival)]


def dspark_lengths(survival: Survival, sps: StepCurve) -> list[int]:
    """Paper Algorithm 1: admit (r, j) in order of a_{r,j} while Θ = τ·SPS(B) strictly improves;
    stop at the first admission that does not improve it (causal, hence lossless)."""
    rows = _rows(survival)
    order = _admission_order(rows)
    throughputs = _throughputs(order, len(rows), sps)
    best, admitted = next(throughputs), 0
    for theta in throughputs:
        if theta <= best:
            break
        best, admitted = theta, admitted + 1
    return _lengths_of(order, admitted, len(rows))


def retrospective_lengths(survival: Survival, sps: StepCurve) -> list[int]:
    """The best prefix of the whole admission path (no early stop; first maximum on ties).

    Escapes local optima of a jagged SPS, but applied to the current confidences it is NOT lossless
    (paper appendix A); only safe on confidences the current drafts cannot influence (§5.2).
    """
    rows = _rows(survival)
    order = _admission_order(rows)
    throughputs = list(_throughputs(order, len(rows), sps))
    admitted = max(range(len(throughputs)), key=lambda i: (throughputs[i], -i))
    return _lengths_of(order, admitted, len(rows))


def async_plan(old_survival: Survival, cost: "StepCurve | RoundCost", num_requests: int | None = None
               ) -> tuple[int, set[int]]:
    """(K, rows that draft): how many drafts to verify this round and which requests need drafting at all,
    decided from confidences at least two rounds old (paper §5.2).

    Those cannot depend on this round's drafts, so the search runs the whole admission path without the early
    stop, and it may also decide who drafts: admitting the k-th best pair costs one more verified token and,
    if its request has no admitted pair yet, that request's draft. Θ_k = (R + Σ_{i≤k} a_i) /
    (1/SPS_R(R + k) + draft(n_k)), n_k the requests among the first k pairs; K = the first maximum (K = 0: no
    one drafts). `num_requests` R defaults to the number of rows.
    """
    rows = _rows(old_survival)
    cost = RoundCost.of(cost)
    requests = len(rows) if num_requests is None else num_requests
    curve = cost.curve(requests)
    best, capacity, drafting = requests * curve(requests), 0, set()
    expected, seen = float(requests), set()
    for k, (a, r, _) in enumerate(_admission_order(rows), start=1):
        expected += a
        seen.add(r)
        theta = expected / (1.0 / curve(requests + k) + cost.draft(len(seen)))
        if theta > best:
            best, capacity, drafting = theta, k, set(seen)
    return capacity, drafting


def async_capacity(survival_two_rounds_ago: Survival, sps: "StepCurve | RoundCost", early_stop: bool = False) -> int:
    """K = total drafts to verify this round, decided from the confidences of two rounds earlier (drafting
    taken as free unless `sps` is a `RoundCost` that prices it). `early_stop` runs Algorithm 1's early stop
    instead of the whole path (not needed on old confidences; kept for comparison)."""
    if early_stop:
        rows = _rows(survival_two_rounds_ago)
        return sum(dspark_lengths(rows, RoundCost.of(sps).curve(len(rows))))
    return async_plan(survival_two_rounds_ago, sps)[0]


def topk_lengths(survival: Survival, k: int) -> list[int]:
    """Verify the K drafts with the highest current a_{r,j} (fewer if fewer have a > 0), as
    contiguous prefixes. Non-anticipating: whether (r, j) makes the cut depends only on pairs ranked
    ahead of it, and r's own later drafts (which do depend on x_{r,j}) all rank behind."""
    rows = _rows(survival)
    return _lengths_of(_admission_order(rows), max(int(k), 0), len(rows))


# ------------------------------------------------------------------------ registry by name


#: a `dspark-async` request that has not drafted for this many rounds times the number of requests drafts again
#: (and the round is scheduled synchronously), so a capacity of 0 cannot switch its drafting off for good, while the
#: batch as a whole spends about one probe per PROBE_EVERY rounds: with a probe every 8 rounds per request, 8
#: requests had one of them drafting in most rounds, ~10% of an 8-request round on a 2-core CPU (session 14)
PROBE_EVERY = 8


@dataclass
class SchedulerState:
    """What a stateful scheduler remembers between rounds, for `dspark-async`: per request key, (round,
    survival) of the last two rounds it drafted in, oldest first; the round number; this round's capacity K
    (None: schedule synchronously), fixed by `begin_round` before anything is drafted; `keys`, the request
    of each survival row the scheduler is called with (the engine sets it; default: the row's index)."""

    history: dict = field(default_factory=dict)
    round: int = 0
    capacity: int | None = None
    keys: list | None = None
    begun: bool = False


class Scheduler(Protocol):
    def __call__(self, survival: Survival, sps: StepCurve, state: SchedulerState | None) -> list[int]: ...


def _none(survival: Survival, sps: StepCurve, state: SchedulerState | None) -> list[int]:
    return [0] * len(_rows(survival))


def _plan_round(cost: "StepCurve | RoundCost", state: SchedulerState, keys: Sequence | None = None) -> set:
    """Start the next round of the requests `keys` (default: those of the last call, or one): fixes the
    async capacity K and returns the keys that draft (empty: none need to, since none would be verified).

    Both come from each request's newest survival at least two rounds old (it cannot depend on this round's
    drafts, so skipping on it is lossless; `async_plan`). A request without such a survival (new), or whose
    newest is over PROBE_EVERY·R rounds old (R requests), drafts to probe, and then dspark-async schedules the
    round by synchronous Algorithm 1 (also lossless), as every round is until two have been seen."""
    state.round += 1
    keys = list(keys if keys is not None else state.keys if state.keys is not None else [0])
    for gone in [key for key in state.history if key not in keys]:
        del state.history[gone]
    old, probing = {}, set()
    for key in keys:
        rounds = state.history.get(key, ())
        usable = [rows for number, rows in rounds if number <= state.round - 2]
        if not usable or state.round - rounds[-1][0] > PROBE_EVERY * len(keys):
            probing.add(key)
        else:
            old[key] = usable[-1]
    planned = [key for key in keys if key in old]
    capacity, rows = async_plan([old[key] for key in planned], cost, len(keys)) if planned else (0, set())
    state.capacity = None if probing else capacity
    state.begun = True
    return probing | {planned[i] for i in rows}


def _dspark(survival: Survival, sps: StepCurve, state: SchedulerState | None) -> list[int]:
    """Algorithm 1 on the current confidences; every request drafts. (Planning who drafts from older
    survival, as dspark-async does, cost 5-7% at one request on code: a lookup draft's worth is not
    predictable two rounds ahead.)"""
    return dspark_lengths(survival, sps)


def _planned_keys(sps: StepCurve, state: SchedulerState, rows: list[list[float]]) -> list:
    """The request key of each row; plans the round first if the caller did not (`begin_round`)."""
    keys = list(state.keys) if state.keys is not None else list(range(len(rows)))
    if len(keys) != len(rows):
        raise DsparkError(f"{len(keys)} request keys for {len(rows)} survival rows")
    if not state.begun:
        _plan_round(sps, state, keys)
    state.begun = False
    return keys


def _remember(state: SchedulerState, keys: Sequence, rows: list[list[float]]) -> None:
    """Each drafting request's survival under its key (one that did not draft keeps its older one)."""
    for key, row in zip(keys, rows, strict=True):
        if row:
            state.history.setdefault(key, deque(maxlen=2)).append((state.round, row))


def _dspark_planned(survival: Survival, sps: StepCurve, state: SchedulerState | None) -> list[int]:
    """Algorithm 1 on the current confidences of the requests that drafted, where who drafts was planned before
    drafting from survival at least two rounds old, as dspark-async plans it (`begin_round`): under load a
    round no longer pays for drafts that Algorithm 1 then leaves unverified. Drafts that cost nothing (a prompt
    lookup hit, `Drafter.drafts_for_free`) are made whatever the plan, since a lookup's worth is not predictable
    two rounds ahead. Lossless: the plan reads no current draft, Algorithm 1 stops causally."""
    rows = _rows(survival)
    if state is not None:
        _remember(state, _planned_keys(sps, state, rows), rows)
    return dspark_lengths(rows, sps)


_dspark_planned.begin_round = _plan_round


def _dspark_async(survival: Survival, sps: StepCurve, state: SchedulerState | None) -> list[int]:
    """Top-K with K from two rounds ago; until two rounds have been seen, or while a request probes (or
    without a state), synchronous Algorithm 1, which is lossless too. The engine calls `begin_round` first
    (and drafts only for the keys it returns); a caller that does not gets one round per call. Each drafting
    request's survival is remembered under its key."""
    rows = _rows(survival)
    if state is None:
        return dspark_lengths(rows, sps)
    keys = _planned_keys(sps, state, rows)
    lengths = dspark_lengths(rows, sps) if state.capacity is None else topk_lengths(rows, state.capacity)
    _remember(state, keys, rows)
    return lengths


_dspark_async.begin_round = _plan_round


def plans_drafting(scheduler: "str | Scheduler") -> bool:
    """Whether the scheduler (by name, or a function) decides who drafts before drafting (`begin_round`), and so
    weighs the draft's cost."""
    return hasattr(get_scheduler(scheduler) if isinstance(scheduler, str) else scheduler, "begin_round")


def get_scheduler(name: str) -> Scheduler:
    """A scheduler by name: "none" (no drafts: plain decoding), "fixed" (every draft), "fixed-<n>",
    "threshold" (t = 0.5) or "threshold-<t>", "dspark" (Algorithm 1), "dspark-planned" (who drafts planned, then
    Algorithm 1), "dspark-async" (§5.2)."""
    if name == "none":
        return _none
    if name == "dspark":
        return _dspark
    if name == "dspark-async":
        return _dspark_async
    if name == "dspark-planned":
        return _dspark_planned
    kind, _, arg = name.partition("-")
    try:
        if kind == "fixed":
            max_verified = int(arg) if arg else 1 << 30
            if max_verified < 0:
                raise ValueError
            return lambda survival, sps, state: fixed_lengths(survival, max_verified)
        if kind == "threshold":
            t = float(arg) if arg else 0.5
            if not 0.0 <= t <= 1.0:
                raise ValueError
            return lambda survival, sps, state: threshold_lengths(survival, t)
    except ValueError:
        pass
    raise DsparkError(f"unknown scheduler {name!r}; use none, fixed, fixed-<n>, threshold, threshold-<t>, "
                      "dspark, dspark-planned or dspark-async")


# --------------------------------------------------------------------- γ, the block size

#: γ when neither the caller nor the drafter names one
DEFAULT_BLOCK_SIZE = 7


def resolve_block_size(requested: int | None, *, drafter_limit: int | None = None,
                       scheduler: str | Scheduler | None = None, request_limit: int | None = None,
                       tokens_left: int | None = None) -> int:
    """γ, the most drafts a round may verify: every cap on it is applied here, and only here (the
    scheduler then verifies ℓ_r ≤ γ of them).

    For a run, γ is `requested`, else the drafter's own block size (`drafter_limit`), else 7; asking
    a DSpark drafter for more than it was trained for is an error (it would draft slots it never
    learnt), and the "none" scheduler verifies nothing (γ = 0). For one request's round, its own
    `request_limit` and `tokens_left` cap it too: the round always emits one token of the target's.
    """
    if requested is None:
        block_size = DEFAULT_BLOCK_SIZE if drafter_limit is None else drafter_limit
    else:
        if drafter_limit is not None and 0 < drafter_limit < requested:
            raise DsparkError(f"block size {requested} exceeds the drafter's block size {drafter_limit}; "
                              "it can only be reduced")
        block_size = requested if drafter_limit is None else min(requested, drafter_limit)
    if isinstance(scheduler, str) and scheduler == "none":
        block_size = 0
    if request_limit is not None:
        block_size = min(block_size, request_limit)
    if tokens_left is not None:
        block_size = max(0, min(block_size, tokens_left - 1))
    return block_size


# ------------------------------------------------------------------------------- overhead


def scheduler_overhead(num_requests: int = 16, gamma: int = 7, repeats: int = 200, seed: int = 0) -> float:
    """Mean seconds per `dspark_lengths` call on random confidences (compare with a ~50 ms round)."""
    rng = random.Random(seed)
    survival = []
    for _ in range(num_requests):
        a, row = 1.0, []
        for _ in range(gamma):
            a *= rng.uniform(0.5, 1.0)
            row.append(a)
        survival.append(row)
    max_tokens = num_requests * (gamma + 1)
    sps = SPSTable(tuple(1.0 / (0.02 + 0.0002 * b) for b in range(1, max_tokens + 1)))
    start = time.perf_counter()
    for _ in range(repeats):
        dspark_lengths(survival, sps)
    return (time.perf_counter() - start) / repeats
