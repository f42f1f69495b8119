"""The prefix schedulers (paper Algorithm 1 and its variants) on hand-made confidences, and the
paper's appendix-A counterexample as a statistical test: the early stop keeps sampling lossless,
the retrospective search does not."""

import json
import math
import random

import pytest
import torch
from scipy.stats import binomtest
from stats_helpers import chi_square_pvalue

from dspark.errors import DsparkError
from dspark.sampling import sample
from dspark.scheduler import (
    DEFAULT_BLOCK_SIZE,
    PROBE_EVERY,
    RoundCost,
    SchedulerState,
    SPSTable,
    async_capacity,
    async_plan,
    dspark_lengths,
    fixed_lengths,
    get_scheduler,
    piecewise_linear_times,
    plans_drafting,
    profile_sps,
    resolve_block_size,
    retrospective_lengths,
    scheduler_overhead,
    threshold_lengths,
    time_interleaved,
    topk_lengths,
)
from dspark.verify import emitted_tokens, verify_sampled

# Appendix A: SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45.
APPENDIX_SPS = SPSTable((1.0, 0.5, 0.45))


def table(fn, max_tokens: int = 300) -> SPSTable:
    return SPSTable(tuple(fn(b) for b in range(1, max_tokens + 1)))


# ------------------------------------------------------------------------------ SPS table


def test_sps_table_smooths_jagged_measurements_to_monotone():
    jagged = [10.0, 9.0, 9.5, 8.0, 8.2, 7.0]
    assert SPSTable.from_measurements(jagged).values == pytest.approx((10, 9.25, 9.25, 8.1, 8.1, 7))
    assert SPSTable.from_measurements(jagged, "running-min").values == (10, 9, 9, 8, 8, 7)
    assert SPSTable.from_measurements([5.0, 6.0, 7.0]).values == pytest.approx((6, 6, 6))  # chained pooling
    with pytest.raises(DsparkError):
        SPSTable((1.0, 2.0))  # the raw constructor insists on monotone values
    with pytest.raises(DsparkError):
        SPSTable.from_measurements(jagged, "cubic")


def test_piecewise_linear_fit_reads_the_slope_where_isotonic_pooling_goes_flat():
    """8 requests: true step time 50 ms + 2 ms a token from B = 8 to 16. One cell reads 10% slow (B = 8), as a
    shared machine's cells do: pooling adjacent violators then makes the first tokens look free, while a line
    through every cell keeps the slope."""
    true = {b: 0.050 + 0.002 * (b - 8) for b in range(8, 17)}
    measured = {**true, 8: true[8] * 1.10}
    isotonic = SPSTable.from_measurements({b: 1 / t for b, t in measured.items()})
    fitted = SPSTable.from_measurements({b: 1 / t for b, t in measured.items()}, "piecewise-linear")
    assert 1 / isotonic(9) - 1 / isotonic(8) == pytest.approx(0.0, abs=1e-12)  # the flat stretch
    slope = (1 / fitted(16) - 1 / fitted(8)) / 8
    assert slope == pytest.approx(0.002, rel=0.2)  # the outlier pulls a line by 17%, not to zero
    assert all(b <= a for a, b in zip(fitted.values, fitted.values[1:], strict=False))
    assert fitted(1) == fitted(8)  # flat before the first measured B (fewer tokens than requests)
    assert fitted.max_tokens == 16


def test_piecewise_linear_fit_recovers_a_curve_that_bends_at_a_doubling():
    """Knots sit at the first B and its doublings, so a curve that is steep up to 16 tokens and shallow after
    (weights read once, then arithmetic) is recovered exactly; a knot whose segment would hold fewer than 4
    cells is dropped."""
    times = {b: 0.050 + 0.002 * (b - 8) - 0.0015 * max(0, b - 16) for b in [*range(8, 33), 40, 48, 56, 64]}
    fitted = piecewise_linear_times(times)
    assert [fitted[b - 1] for b in times] == pytest.approx(list(times.values()), rel=1e-9)
    few = piecewise_linear_times({1: 0.030, 2: 0.031, 3: 0.032, 8: 0.037})  # knot 2 and 4: segments too short
    assert few == pytest.approx([0.030 + 0.001 * (b - 1) for b in range(1, 9)], rel=1e-9)
    rising = SPSTable.from_measurements({1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0}, "piecewise-linear")
    assert rising.values == pytest.approx((11.5,) * 4, rel=0.02)  # a faster-with-more-tokens fit is pooled flat
    with pytest.raises(DsparkError):
        piecewise_linear_times({0: 0.01, 1: 0.02})


def test_sps_table_interpolates_sparse_measurements_and_clamps_lookups():
    sps = SPSTable.from_measurements({4: 7.0, 1: 10.0})
    assert sps.values == pytest.approx((10, 9, 8, 7))
    assert sps.max_tokens == 4
    assert sps.sps(0) == sps(1) == 10.0
    assert sps(100) == sps(4) == pytest.approx(7.0)


def test_sps_table_json_round_trip():
    sps = SPSTable.from_measurements([3.0, 2.5, 2.75, 1.0])
    assert json.loads(sps.to_json())["sps"] == list(sps.values)
    assert SPSTable.from_json(sps.to_json()) == sps


def test_profile_sps_times_a_fake_forward(monkeypatch):
    """A fake clock: forward(B) takes 10 ms + 1 ms·B, except B = 5, which is measured jagged-fast (13 ms)."""
    clock = [0.0]
    calls = []

    def forward(num_tokens: int) -> None:
        calls.append(num_tokens)
        clock[0] += 0.013 if num_tokens == 5 else 0.010 + 0.001 * num_tokens

    monkeypatch.setattr("dspark.scheduler.time.perf_counter", lambda: clock[0])
    sps = profile_sps(forward, max_tokens=8, repeats=3, warmup=1)
    assert calls[:8] == list(range(1, 9))  # one warm-up each, then 3 passes over every size in shuffled orders
    assert all(sorted(calls[start : start + 8]) == list(range(1, 9)) for start in (8, 16, 24)) and len(calls) == 32
    assert calls[8:16] != list(range(1, 9))
    assert sps.max_tokens == 8
    assert all(b <= a for a, b in zip(sps.values, sps.values[1:], strict=False))
    assert sps(1) == pytest.approx(1 / 0.011)
    assert sps(8) == pytest.approx(1 / 0.018)
    assert sps(4) == sps(5) == pytest.approx((1 / 0.014 + 1 / 0.013) / 2)  # the outlier is pooled, not trusted

    calls.clear()
    sparse = profile_sps(forward, max_tokens=8, repeats=1, warmup=0, sizes=[1, 8])
    assert sorted(calls) == [1, 8] and sparse.max_tokens == 8
    assert sparse(1) == pytest.approx(1 / 0.011) and sparse(8) == pytest.approx(1 / 0.018)


def test_interleaved_timing_spreads_a_slow_spell_over_every_cell(monkeypatch):
    """Every call takes 1 s, but the first 2 passes' worth of calls run in a slow spell (+1 s). Timed one cell
    after another, the first cell would read 2 s (all its timings in the spell) and the curve would tilt;
    interleaved, each cell has 2 of 5 timings in the spell and its median is the true 1 s."""
    clock, calls = [0.0], []

    def cell(name):
        def call():
            calls.append(name)
            timed = len(calls) - 3  # after the 3 warm-up calls
            clock[0] += 2.0 if 0 <= timed < 6 else 1.0
        return call

    monkeypatch.setattr("dspark.scheduler.time.perf_counter", lambda: clock[0])
    seconds = time_interleaved({name: cell(name) for name in "abc"}, repeats=5, warmup=1)
    assert seconds == {"a": 1.0, "b": 1.0, "c": 1.0}
    assert len(calls) == 18 and calls[:3] == ["a", "b", "c"]


# -------------------------------------------------------------------- simple schedulers


SURVIVAL = [[0.9, 0.6, 0.3], [0.8, 0.1], []]


def test_fixed_threshold_and_topk():
    assert fixed_lengths(SURVIVAL, 2) == [2, 2, 0]
    assert fixed_lengths(SURVIVAL, 0) == [0, 0, 0]
    assert threshold_lengths(SURVIVAL, 0.5) == [2, 1, 0]
    assert threshold_lengths(SURVIVAL, 0.6) == [2, 1, 0]  # a_k >= t is kept
    assert threshold_lengths(SURVIVAL, 0.0) == [3, 2, 0]
    assert topk_lengths(SURVIVAL, 0) == [0, 0, 0]
    assert topk_lengths(SURVIVAL, 2) == [1, 1, 0]
    assert topk_lengths(SURVIVAL, 3) == [2, 1, 0]
    assert topk_lengths(SURVIVAL, 99) == [3, 2, 0]


def test_ties_keep_prefixes_contiguous():
    """Equal survival (c = 1) must not admit a request's 2nd draft before another request's 1st."""
    assert topk_lengths([[0.5, 0.5], [0.5]], 2) == [1, 1]
    assert topk_lengths([[0.5, 0.5, 0.5]], 2) == [2]


def test_zero_survival_is_never_verified():
    flat = table(lambda b: 1.0)
    assert dspark_lengths([[0.9, 0.0, 0.0]], flat) == [1]
    assert retrospective_lengths([[0.9, 0.0]], flat) == [1]
    assert topk_lengths([[0.9, 0.0]], 5) == [1]


def test_inputs_accept_tensors_and_reject_bad_survival():
    assert dspark_lengths(torch.tensor([[0.9, 0.6], [0.8, 0.1]]), table(lambda b: 1.0)) == [2, 2]
    with pytest.raises(ValueError):
        dspark_lengths([[0.5, 0.6]], APPENDIX_SPS)  # increasing: not a cumulative product
    with pytest.raises(ValueError):
        dspark_lengths([[math.nan]], APPENDIX_SPS)


# ------------------------------------------------------------------------- Algorithm 1


def test_algorithm_1_hand_computed_two_requests():
    """Θ: 2·1.0 = 2.0; +0.9 → 2.9·0.8 = 2.32; +0.8 → 3.7·0.7 = 2.59; +0.6 → 4.3·0.65 = 2.795;
    +0.1 → 4.4·0.6 = 2.64 ≤ 2.795: stop."""
    sps = SPSTable((1.0, 1.0, 0.8, 0.7, 0.65, 0.6))
    survival = [[0.9, 0.6], [0.8, 0.1]]
    assert dspark_lengths(survival, sps) == [2, 1]
    assert retrospective_lengths(survival, sps) == [2, 1]


def test_algorithm_1_stops_at_first_non_improvement_although_a_later_prefix_is_better():
    """Appendix A: Θ0 = 1.0, Θ1 = 1.8·0.5 = 0.9, Θ2 = 2.52·0.45 = 1.134. Algorithm 1 stops at Θ1;
    the retrospective search picks the global maximum Θ2."""
    assert dspark_lengths([[0.8, 0.72]], APPENDIX_SPS) == [0]
    assert retrospective_lengths([[0.8, 0.72]], APPENDIX_SPS) == [2]
    assert retrospective_lengths([[0.8, 0.0]], APPENDIX_SPS) == [0]


def test_algorithm_1_needs_strict_improvement():
    sps = SPSTable((1.5, 1.0))
    assert dspark_lengths([[0.5]], sps) == [0]  # Θ1 = 1.5·1.0 = Θ0
    assert dspark_lengths([[0.51]], sps) == [1]


def test_algorithm_1_is_load_aware():
    """The same confidences get a shorter verification under a steeper SPS (a busier engine)."""
    survival = [[0.9, 0.8, 0.6, 0.4, 0.2]]
    free = table(lambda b: 1.0)
    cheap = table(lambda b: 1 / (0.02 + 0.001 * b))
    steep = table(lambda b: 1 / (0.02 + 0.01 * b))
    assert dspark_lengths(survival, free) == [5]
    assert dspark_lengths(survival, cheap)[0] > dspark_lengths(survival, steep)[0]


def _random_survival(rng: random.Random, gamma: int = 7) -> list[float]:
    a, row = 1.0, []
    for _ in range(gamma):
        a *= rng.uniform(0.3, 1.0)
        row.append(a)
    return row


@pytest.mark.parametrize("name", ["latency-linear", "saturating"])
def test_budget_per_request_does_not_grow_with_concurrency(name):
    """Concave token throughput B·SPS(B): more requests with the same confidences never get a larger
    mean verification budget each (the engine has less spare compute per request)."""
    sps = {
        "latency-linear": table(lambda b: 1 / (0.02 + 0.0005 * b)),
        "saturating": table(lambda b: 1.0 if b <= 24 else 24 / b),
    }[name]
    rng = random.Random(0)
    survivals = [[0.9**k for k in range(1, 8)], [0.95, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1]]
    survivals += [_random_survival(rng) for _ in range(8)]
    for survival in survivals:
        means = [sum(dspark_lengths([survival] * r, sps)) / r for r in range(1, 33)]
        assert all(later <= earlier + 1e-12 for earlier, later in zip(means, means[1:], strict=False)), means
        assert means[0] > means[-1]


# ------------------------------------------------------------------- production variant


def test_async_capacity_searches_past_the_early_stop():
    assert async_capacity([[0.8, 0.72]], APPENDIX_SPS) == 2
    assert async_capacity([[0.8, 0.72]], APPENDIX_SPS, early_stop=True) == 0


def test_registry():
    sps = table(lambda b: 1.0)
    assert get_scheduler("none")(SURVIVAL, sps, None) == [0, 0, 0]
    assert get_scheduler("fixed-1")(SURVIVAL, sps, None) == [1, 1, 0]
    assert get_scheduler("fixed")(SURVIVAL, sps, None) == [3, 2, 0]
    assert get_scheduler("threshold")(SURVIVAL, sps, None) == [2, 1, 0]
    assert get_scheduler("threshold-0.7")(SURVIVAL, sps, None) == [1, 1, 0]
    assert get_scheduler("dspark")(SURVIVAL, sps, None) == [3, 2, 0]
    for bad in ["fixed-x", "fixed--1", "threshold-2", "eagle", "dspark-sync"]:
        with pytest.raises(DsparkError):
            get_scheduler(bad)


def test_dspark_async_uses_capacity_from_two_rounds_ago():
    sps = table(lambda b: 1 / (0.02 + 0.005 * b))
    confident, doubtful = [[0.99] * 4, [0.98] * 4], [[0.3, 0.1, 0.05, 0.01], [0.2, 0.1, 0.05, 0.01]]
    scheduler, state = get_scheduler("dspark-async"), SchedulerState()
    # Rounds 1 and 2: nothing two rounds old yet, so synchronous Algorithm 1.
    assert scheduler(confident, sps, state) == dspark_lengths(confident, sps)
    assert scheduler(doubtful, sps, state) == dspark_lengths(doubtful, sps)
    # Round 3: K comes from round 1's confident drafts; the current ones are ranked for the top-K.
    k = async_capacity(confident, sps)
    assert k > sum(dspark_lengths(doubtful, sps))
    assert scheduler(doubtful, sps, state) == topk_lengths(doubtful, k)
    # Round 4: K from round 2's doubtful drafts.
    assert scheduler(confident, sps, state) == topk_lengths(confident, async_capacity(doubtful, sps))
    assert scheduler(confident, sps, None) == dspark_lengths(confident, sps)  # stateless fallback



def test_dspark_async_begin_round_skips_on_zero_capacity_and_probes():
    sps = table(lambda b: 1 / (0.02 + 0.05 * b))
    hopeless = [[0.001] * 4]
    assert async_capacity(hopeless, sps) == 0
    scheduler, state = get_scheduler("dspark-async"), SchedulerState()
    drafted = []
    for _ in range(30):
        if scheduler.begin_round(sps, state):
            drafted.append(state.round)
            assert scheduler(hopeless, sps, state) == [0]
        else:
            assert state.capacity == 0  # known before drafting, from survival at least two rounds old
    # rounds 1-2 synchronous, then a probe once the newest survival is PROBE_EVERY + 1 rounds old
    assert drafted == [1, 2, 3 + PROBE_EVERY, 4 + 2 * PROBE_EVERY, 5 + 3 * PROBE_EVERY]
    assert [number for number, _ in state.history[0]] == drafted[-2:]


def test_dspark_async_probes_once_per_probe_every_rounds_per_batch_not_per_request():
    """Four hopeless requests: each probes every PROBE_EVERY·4 rounds, so the batch drafts about once per
    PROBE_EVERY rounds instead of four times (a probe is a drafter forward the round then rarely uses)."""
    sps = table(lambda b: 1 / (0.02 + 0.05 * b))
    scheduler, state, keys = get_scheduler("dspark-async"), SchedulerState(), ["a", "b", "c", "d"]
    probes = {key: [] for key in keys}
    for _ in range(2 + 4 * PROBE_EVERY * 3):
        drafting = scheduler.begin_round(sps, state, keys)
        state.keys = keys
        for key in drafting:
            probes[key].append(state.round)
        assert scheduler([[0.001] * 4 if key in drafting else [] for key in keys], sps, state) == [0] * 4
    for rounds in probes.values():
        assert rounds[:2] == [1, 2]  # new: synchronous until two rounds have been seen
        gaps = [b - a for a, b in zip(rounds[1:], rounds[2:], strict=False)]
        assert gaps == [4 * PROBE_EVERY + 1] * (len(rounds) - 2)
    assert sum(len(rounds) - 2 for rounds in probes.values()) <= 4 * 3  # ~1 probe per PROBE_EVERY rounds in all


def test_round_cost_interpolates_step_time_between_request_counts():
    one, four = table(lambda b: 1 / (0.01 + 0.001 * b), 40), table(lambda b: 1 / (0.03 + 0.001 * b), 40)
    cost = RoundCost({1: one, 4: four}, {1: 0.002, 4: 0.005})
    assert cost.curve(1) is one and cost.curve(4) is four and cost.curve(9) is four  # clamped beyond
    assert 1 / cost.curve(2)(10) == pytest.approx(0.02 + 0.02 / 3)  # a third of the way from R = 1 to R = 4
    assert cost.draft(0) == 0.0 and cost.draft(2) == pytest.approx(0.003) and cost.draft(8) == pytest.approx(0.01)
    assert RoundCost.from_json(cost.to_json()) == cost
    assert RoundCost.of(one).curve(7) is one and RoundCost.of(cost) is cost
    with pytest.raises(DsparkError):
        RoundCost({})
    with pytest.raises(DsparkError):
        RoundCost({1: one}, {1: float("nan")})


def test_async_plan_weighs_the_draft_against_what_it_brings():
    """Free drafting: the plan is the retrospective search, and only the requests with admitted drafts draft.
    Priced drafting: a draft that brings little is not worth making (K = 0, no one drafts)."""
    flat = table(lambda b: 1 / (0.02 + 0.0005 * b))
    survival = [[0.9, 0.8, 0.1], [0.05, 0.01, 0.0], [0.7, 0.2, 0.1]]
    capacity, rows = async_plan(survival, flat)
    assert capacity == sum(retrospective_lengths(survival, flat)) and rows == {0, 2}
    assert async_plan(survival, RoundCost({1: flat}, {1: 0.2})) == (0, set())  # 0.2 s a draft: never pays
    cheap = async_plan(survival, RoundCost({1: flat}, {1: 0.001, 3: 0.003}))
    assert cheap[1] <= {0, 2} and cheap[0] >= 2


def test_dspark_async_drafts_only_for_the_requests_it_planned():
    """Requests keyed by id: a new one probes (the round runs synchronous Algorithm 1); afterwards each
    request's own survival two rounds old decides whether it drafts; a request that leaves is forgotten."""
    sps = table(lambda b: 1 / (0.02 + 0.0005 * b))
    confident, hopeless = [0.99] * 4, [0.001] * 4
    scheduler, state = get_scheduler("dspark-async"), SchedulerState()
    for _ in range(2):  # rounds 1-2: nothing two rounds old yet
        assert scheduler.begin_round(sps, state, ["a", "b"]) == {"a", "b"} and state.capacity is None
        state.keys = ["a", "b"]
        scheduler([confident, hopeless], sps, state)
    assert scheduler.begin_round(sps, state, ["a", "b"]) == {"a"} and state.capacity == 4
    state.keys = ["a", "b"]
    assert scheduler([confident, []], sps, state) == [4, 0]  # b did not draft: it keeps its older survival
    assert [number for number, _ in state.history["b"]] == [1, 2]
    assert scheduler.begin_round(sps, state, ["a", "c"]) == {"a", "c"} and state.capacity is None  # c probes
    assert "b" not in state.history
    state.keys = ["a", "c"]
    with pytest.raises(DsparkError, match="keys"):
        scheduler([confident], sps, state)


def test_dspark_planned_plans_who_drafts_like_dspark_async_but_verifies_by_current_confidences():
    """Who drafts comes from survival two rounds old (a hopeless request stops drafting, as under dspark-async),
    but how much of the drafts is verified is Algorithm 1 on the current confidences: where dspark-async verifies
    its old capacity's top-K of drafts that turned hopeless, dspark-planned stops at the first that does not pay."""
    sps = table(lambda b: 1 / (0.02 + 0.0005 * b))
    confident, hopeless = [0.99] * 4, [0.001] * 4
    for name, verified in (("dspark-async", [4, 0]), ("dspark-planned", [0, 0])):
        scheduler, state = get_scheduler(name), SchedulerState()
        for _ in range(2):
            assert scheduler.begin_round(sps, state, ["a", "b"]) == {"a", "b"}
            state.keys = ["a", "b"]
            assert scheduler([confident, hopeless], sps, state) == dspark_lengths([confident, hopeless], sps)
        assert scheduler.begin_round(sps, state, ["a", "b"]) == {"a"}  # b's old survival: not worth drafting
        state.keys = ["a", "b"]
        assert scheduler([hopeless, []], sps, state) == verified
        assert [number for number, _ in state.history["a"]] == [2, 3] and len(state.history["b"]) == 2
    assert get_scheduler("dspark-planned")([confident, hopeless], sps, None) == dspark_lengths([confident, hopeless],
                                                                                               sps)


def test_scheduler_overhead_runs():
    assert scheduler_overhead(num_requests=4, gamma=3, repeats=3) > 0.0


# ------------------------------------------------------------------- appendix A by simulation

P = torch.tensor([0.7, 0.3])  # target: i.i.d. over {A, B}
Q = torch.tensor([0.5, 0.5])  # draft
TOKEN_A = 0
SAMPLES = 20_000
ALPHA = 1e-3


def _toy_round(schedule, sps: SPSTable, generator: torch.Generator) -> list[int]:
    """One round, R = 1, γ = 2: draft x_1, x_2 ~ q; confidence c_1 = 0.8 (= Σ min(p, q), known before
    x_1 is drawn) and c_2 = 0.9 after x_1 = A, 0 after x_1 = B (a Markov confidence head's c_2 sees
    x_1); schedule ℓ from the survival (0.8, 0.8·c_2); verify the first ℓ drafts; emitted tokens."""
    drafts = sample(Q.expand(2, 2), generator)
    c2 = 0.9 if int(drafts[0]) == TOKEN_A else 0.0
    length = schedule([[0.8, 0.8 * c2]], sps)[0]
    verdict = verify_sampled(drafts[:length], Q.expand(length, 2), P.expand(length + 1, 2), generator)
    return emitted_tokens(drafts[:length], verdict)


def _first_tokens(schedule, sps: SPSTable, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.tensor([_toy_round(schedule, sps, generator)[0] for _ in range(SAMPLES)])


def test_appendix_a_schedules_as_in_the_paper():
    survival_after = {"A": [[0.8, 0.72]], "B": [[0.8, 0.0]]}
    assert [retrospective_lengths(survival_after[x], APPENDIX_SPS) for x in "AB"] == [[2], [0]]
    assert [dspark_lengths(survival_after[x], APPENDIX_SPS) for x in "AB"] == [[0], [0]]


def test_appendix_a_early_stop_is_lossless_and_retrospective_search_is_not():
    """The first emitted token must be A with probability p(A) = 0.7. Algorithm 1 decides from
    c_1 alone (Θ1 < Θ0: stop), so it is; the retrospective search admits x_1 only when x_1 = A
    (it looked at c_2), which the paper computes to give 0.5 + 0.5·0.7 = 0.85."""
    causal = _first_tokens(dspark_lengths, APPENDIX_SPS, seed=1)
    peeking = _first_tokens(retrospective_lengths, APPENDIX_SPS, seed=1)
    causal_a, peeking_a = int((causal == TOKEN_A).sum()), int((peeking == TOKEN_A).sum())
    assert binomtest(causal_a, SAMPLES, 0.7).pvalue > ALPHA
    assert binomtest(peeking_a, SAMPLES, 0.7).pvalue < ALPHA  # the negative control fails the test
    assert peeking_a / SAMPLES == pytest.approx(0.85, abs=0.01)


def test_causal_admission_that_depends_on_earlier_drafts_is_lossless():
    """With SPS(2) = 0.6, Algorithm 1 admits x_1 (Θ1 = 1.08 > 1) and then admits x_2 only after
    x_1 = A (Θ2 = 1.134): deciding on x_2 from x_1 is allowed. The first two emitted tokens must be
    i.i.d. p (chi-square on the four pairs)."""
    sps = SPSTable((1.0, 0.6, 0.45))
    assert dspark_lengths([[0.8, 0.72]], sps) == [2] and dspark_lengths([[0.8, 0.0]], sps) == [1]
    generator = torch.Generator().manual_seed(2)
    pairs = []
    for _ in range(SAMPLES):
        tokens = _toy_round(dspark_lengths, sps, generator)
        while len(tokens) < 2:
            tokens += _toy_round(dspark_lengths, sps, generator)
        pairs.append(2 * tokens[0] + tokens[1])
    assert chi_square_pvalue(torch.tensor(pairs), torch.outer(P, P).flatten()) > ALPHA


# ------------------------------------------------------------------------------ γ and the choice


def test_resolve_block_size_applies_every_cap():
    assert resolve_block_size(None) == DEFAULT_BLOCK_SIZE
    assert resolve_block_size(None, drafter_limit=4) == 4  # the drafter's own
    assert resolve_block_size(3, drafter_limit=4) == 3
    assert resolve_block_size(9) == 9  # an unbounded drafter (n-gram)
    assert resolve_block_size(5, drafter_limit=0) == 0  # NoDrafter: nothing to draft, and no error
    with pytest.raises(DsparkError, match="can only be reduced"):
        resolve_block_size(5, drafter_limit=4)
    assert resolve_block_size(4, scheduler="none") == 0
    assert resolve_block_size(4, scheduler=get_scheduler("none")) == 4  # only the name means γ = 0
    assert resolve_block_size(4, request_limit=2, tokens_left=10) == 2
    assert resolve_block_size(4, tokens_left=3) == 2  # the round always adds one token of the target's
    assert resolve_block_size(4, request_limit=-1, tokens_left=0) == 0


def test_drafters_without_confidences_verify_every_draft():
    from types import SimpleNamespace

    from dspark.factory import scheduler_for

    plain, confident = SimpleNamespace(), SimpleNamespace(config=SimpleNamespace(enable_confidence_head=True))
    assert [scheduler_for(name, plain, 4) for name in ("dspark", "threshold", "fixed-2", "none")] == [
        "fixed", "fixed", "fixed-2", "none"]
    assert scheduler_for("dspark-async", confident, 4) == "dspark-async"
    assert scheduler_for("dspark", confident, 0) == "fixed"  # γ = 0: nothing to schedule
    with pytest.raises(DsparkError, match="unknown scheduler"):
        scheduler_for("sometimes", confident, 4)


def test_the_schedulers_that_plan_drafting_are_those_with_begin_round():
    assert plans_drafting("dspark-async") and plans_drafting("dspark-planned")
    assert not any(plans_drafting(name) for name in ("none", "fixed-3", "threshold", "dspark"))
    assert plans_drafting(get_scheduler("dspark-async")) and not plans_drafting(lambda survival, sps, state: [])
