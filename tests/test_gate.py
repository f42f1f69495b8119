"""The draft gate: measured tokens/s of drafting and plain rounds decide whether the next round drafts."""

import pytest

from dspark.errors import DsparkError
from dspark.factory import resolve_gate
from dspark.gate import DraftGate

PLAIN = (8, 0.05)  # tokens, seconds of one round: 160 tokens/s
DRAFT = (9, 0.07)  # ~129 tokens/s: plain 24% faster, so the loser is retried after 3 x explore_every rounds


def play(gate: DraftGate, rounds: int, costs: dict[bool, tuple[int, float]], num_requests: int = 8) -> list[bool]:
    choices = []
    for _ in range(rounds):
        drafted = gate.should_draft(num_requests)
        choices.append(drafted)
        gate.record(num_requests, drafted, *costs[drafted])
    return choices


def test_measures_drafting_then_plain_then_keeps_the_faster_and_retries_the_other():
    gate = DraftGate(min_rounds=2, explore_every=4)
    choices = play(gate, 60, {True: DRAFT, False: PLAIN})
    assert choices[:4] == [True, True, False, False]
    # retried after 3 x explore_every rounds (24% apart), then twice as rarely after each retry that lost again
    assert choices[4:] == [False] * 12 + [True] + [False] * 24 + [True] + [False] * 18
    summary = gate.summary()[8]
    assert summary["plain"] == pytest.approx(160.0) and summary["draft"] == pytest.approx(9 / 0.07, abs=0.01)
    assert summary["draft_rounds"] + summary["plain_rounds"] == 60
    later = play(gate, 300, {True: DRAFT, False: PLAIN})
    retries = [i for i, drafted in enumerate(later) if drafted]
    assert {b - a for a, b in zip(retries[:-1], retries[1:], strict=True)} == {33}  # 8 x explore_every apart


def test_keeps_drafting_where_drafting_is_faster_and_retries_a_close_loser_sooner():
    choices = play(DraftGate(min_rounds=1, explore_every=8), 28, {True: (12, 0.07), False: PLAIN})  # 7% apart
    assert choices[:2] == [True, False]
    assert choices[2:] == [True] * 8 + [False] + [True] * 16 + [False]
    choices = play(DraftGate(min_rounds=1, explore_every=8), 40, {True: (40, 0.07), False: PLAIN})  # 3.6x
    assert choices[2:] == [True] * 32 + [False] + [True] * 5


def test_switches_when_drafting_starts_to_pay():
    gate = DraftGate(min_rounds=2, explore_every=4)
    play(gate, 20, {True: DRAFT, False: PLAIN})
    assert not gate.should_draft(8)
    choices = play(gate, 30, {True: (30, 0.07), False: PLAIN})  # e.g. the text turned repetitive
    first = choices.index(True)  # the next retry: 6 x explore_every after the one that lost
    assert first <= 24 and all(choices[first:first + 4])


def test_each_number_of_requests_is_judged_on_its_own():
    gate = DraftGate(min_rounds=1, explore_every=100)
    play(gate, 6, {True: DRAFT, False: PLAIN}, num_requests=8)
    play(gate, 6, {True: (3, 0.03), False: (1, 0.025)}, num_requests=1)
    assert not gate.should_draft(8) and gate.should_draft(1)
    assert gate.should_draft(4)  # never seen: drafts first, as the scheduler would


def test_ignores_rounds_without_time_and_rejects_bad_settings():
    gate = DraftGate()
    gate.record(2, True, 3, 0.0)
    assert gate.summary().get(2, {}).get("draft_rounds", 0) == 0
    bad_settings = ({"min_rounds": 0}, {"explore_every": 0}, {"keep": 1.0}, {"keep": -0.1}, {"margin": -0.5},
                    {"share": -1.0})
    for bad in bad_settings:
        with pytest.raises(DsparkError):
            DraftGate(**bad)


def test_engines_get_a_gate_for_the_dspark_schedulers_only():
    shared = DraftGate()
    assert isinstance(resolve_gate(None, "dspark", 7), DraftGate)
    assert isinstance(resolve_gate(None, "dspark-async", 7), DraftGate)
    assert resolve_gate(None, "fixed", 7) is None and resolve_gate(None, "none", 7) is None
    assert resolve_gate(None, "dspark", 0) is None  # nothing to draft
    assert resolve_gate(False, "dspark", 7) is None
    assert isinstance(resolve_gate(True, "fixed-3", 7), DraftGate)
    assert resolve_gate(shared, "dspark", 7) is shared


def test_a_retried_mode_is_kept_until_one_of_its_rounds_is_recorded():
    """The engine does not record every round (prompt chunks, a drafter catching up): a retry must not be lost."""
    gate = DraftGate(min_rounds=1, explore_every=2)
    play(gate, 5, {True: DRAFT, False: PLAIN})  # drafting measured slower: plain from the third round
    while not gate.should_draft(8):
        gate.record(8, False, *PLAIN)
    assert gate.should_draft(8) and gate.should_draft(8)  # unrecorded: still retrying drafting
    gate.record(8, True, *DRAFT)
    assert not gate.should_draft(8)


def test_drafting_stops_only_when_plain_decoding_measures_clearly_faster():
    """Drafting is the scheduler's choice; plain decoding must beat it by the margin (10% at one request, 10%/sqrt(R)
    at R: a round's tokens sum over R requests, and so does their noise) to take over."""
    costs = {True: (8.8, 0.0575), False: PLAIN}  # drafting 153 tokens/s: plain 4.5% faster
    choices = play(DraftGate(min_rounds=1, explore_every=4), 20, costs, num_requests=1)  # within 10%
    assert choices[2:].count(False) <= 4  # only the retries of plain decoding
    choices = play(DraftGate(min_rounds=1, explore_every=4, margin=0.0), 20, costs, num_requests=1)
    assert choices[2:].count(True) <= 4
    choices = play(DraftGate(min_rounds=1, explore_every=4), 20, costs, num_requests=8)  # beyond 10% / sqrt(8)
    assert choices[2:].count(True) <= 4
    choices = play(DraftGate(min_rounds=1, explore_every=4), 20, {True: (8.8, 0.0575), False: (9.0, 0.0575)},
                   num_requests=8)  # plain 2.3% faster: within 3.5%
    assert choices[2:].count(False) <= 4


def test_a_mode_retried_after_many_rounds_is_judged_mostly_by_its_new_round():
    gate = DraftGate(min_rounds=1)
    gate.record(8, True, 10, 1.0)  # drafting once measured 10 tokens/s
    for _ in range(20):
        gate.record(8, False, 20, 1.0)
    gate.record(8, True, 30, 1.0)  # 21 rounds later: 30 tokens/s
    assert gate.summary()[8]["draft"] > 25


def test_a_number_of_requests_near_a_measured_one_starts_from_its_choice():
    """A batch's tail (7, 6, ... requests left) borrows the nearest measured R's averages instead of measuring
    both modes at every R; a far one measures afresh, and a borrowed choice is retried after explore_every rounds."""
    gate = DraftGate(min_rounds=2, explore_every=4)
    play(gate, 8, {True: DRAFT, False: PLAIN})  # at 8 requests plain measured 24% faster
    choices = play(gate, 6, {True: (8, 0.07), False: (7, 0.05)}, num_requests=7)
    assert choices == [False] * 4 + [True, False]  # no measuring rounds; drafting retried after 4 rounds
    assert gate.summary()[7]["plain_rounds"] == 5 and gate.summary()[7]["draft_rounds"] == 1
    fresh = DraftGate(min_rounds=2, explore_every=4)
    play(fresh, 8, {True: DRAFT, False: PLAIN})
    assert fresh.should_draft(7) is False and fresh.rates[7][False].throughput == pytest.approx(160.0 * 7 / 8)
    assert fresh.should_draft(5) is True  # 3 away from 8 (> 25% of 8): measured afresh, drafting first
    assert fresh.rates[5][True].rounds == 0 and not fresh.rates[5][True].borrowed
    unshared = DraftGate(min_rounds=2, explore_every=4, share=0.0)
    play(unshared, 8, {True: DRAFT, False: PLAIN})
    assert unshared.should_draft(7) is True  # share 0: every R measures on its own, drafting first


def test_a_number_of_requests_first_seen_before_its_neighbour_was_measured_borrows_once_it_is():
    """A batch's first decode round runs at R - 1 while its last prompt is still in prefill, before any round at R:
    that R - 1 must not stay unmeasured (and so measure both modes again on every batch)."""
    gate = DraftGate(min_rounds=2, explore_every=4)
    assert gate.should_draft(7, measured=False) is True  # nothing known anywhere: drafting, the scheduler's own
    play(gate, 8, {True: DRAFT, False: PLAIN})  # then 8 requests measure plain 24% faster
    assert gate.should_draft(7) is False and gate.rates[7][False].borrowed


def test_a_round_the_engine_cannot_measure_is_not_spent_measuring_or_retrying():
    """A round that carries a prompt chunk is not recorded, so it takes the best mode known: not drafting first on
    a fresh R (once plain decoding is known to win), not the retry of the loser (which waits for a measured round)."""
    gate = DraftGate(min_rounds=2, explore_every=4)
    play(gate, 4, {True: DRAFT, False: PLAIN})  # measured: plain decoding wins at 8
    plain_rounds = 0
    while not gate.should_draft(8):  # plain rounds until the loser's retry is due
        gate.record(8, False, *PLAIN)
        plain_rounds += 1
    assert plain_rounds == 12  # 3 x explore_every: plain 24% faster
    assert gate.should_draft(8, measured=False) is False  # the retry is due, but an unmeasured round takes the winner
    assert gate.should_draft(8) is True  # and the retry waits for the next measured round
    fast = DraftGate(min_rounds=2, explore_every=4)
    play(fast, 4, {True: PLAIN, False: DRAFT})  # here drafting wins
    assert fast.should_draft(8, measured=False) is True
    unsettled = DraftGate(min_rounds=2, explore_every=4)
    play(unsettled, 1, {True: DRAFT, False: PLAIN})
    assert unsettled.should_draft(8, measured=False) is True  # only drafting measured (once): keep drafting


def test_a_retry_that_wins_resets_the_wait():
    gate = DraftGate(min_rounds=1, explore_every=2)
    play(gate, 12, {True: DRAFT, False: PLAIN})  # drafting retried and lost: its retries now wait longer
    assert gate.lost_retries[8] >= 1
    while not gate.should_draft(8):
        gate.record(8, False, *PLAIN)
    gate.record(8, True, 30, 0.07)  # the retry wins by far: drafting takes over
    assert gate.lost_retries[8] == 0 and gate.should_draft(8)
