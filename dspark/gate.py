"""The draft gate: whether drafting pays this round, judged from the engine's own rounds.

Algorithm 1 decides how many of the drafts to verify once they exist, so a request always pays for its draft;
under load, where a verified token costs almost nothing but a draft does not, that loses to plain decoding
(session 14: dspark 0.88x of no speculation at 8 requests on chat). The profiled prices that dspark-planned and
dspark-async weigh drafts with miss what a round really spends (commit projections, scheduling, the verify
tail), so the gate measures instead: for every number of running requests R, the tokens per second of the
rounds that drafted and of the rounds that did not, as moving averages, and drafts in the next round with R
requests when drafting measured faster. The other mode is retried every `explore_every` rounds, so a change
(longer contexts, another domain, a busier machine) is seen. Skipping a draft is lossless: the decision reads no
draft, only past round times. Rounds that carry prompt chunks are not recorded (a prefill dwarfs the decode), nor
rounds whose drafter first absorbs many committed positions (a request's prompt, or the rounds it did not draft,
`Drafter.pending_positions`): that catch-up is paid once, not per drafting round, and counting it made a retried
drafting round look slow exactly because the rounds before it had not drafted.
"""

import math
from dataclasses import dataclass, field

from dspark.errors import DsparkError


@dataclass
class _Rate:
    """Moving averages of the tokens and seconds of one mode's rounds (their ratio is its throughput)."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0  # rounds recorded at this number of requests
    last: int = 0  # the gate's round count (both modes) when this mode was last recorded
    borrowed: bool = False  # started from a neighbouring number of requests' averages

    def add(self, tokens: float, seconds: float, keep: float, now: int) -> None:
        """The past decays by `keep` per round of *either* mode since it was measured: a mode retried after 16
        rounds of the other is mostly judged by the new round, not by what it measured under older conditions."""
        weight = keep ** (now - self.last) if self.rounds or self.borrowed else 0.0
        self.tokens = weight * self.tokens + (1 - weight) * tokens
        self.seconds = weight * self.seconds + (1 - weight) * seconds
        self.rounds += 1
        self.last = now

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def settled(self, min_rounds: int) -> bool:
        """Whether this mode has an estimate to choose by: measured min_rounds times, or borrowed."""
        return self.borrowed or self.rounds >= min_rounds

    def scaled(self, factor: float) -> "_Rate":
        """This mode's averages as a prior for another number of requests (tokens scaled, no rounds of its own)."""
        return _Rate(self.tokens * factor, self.seconds, borrowed=True)


@dataclass
class DraftGate:
    """Per number of running requests: draft or not, whichever measured more tokens per second.

    `min_rounds`: rounds of each mode measured before the gate chooses (drafting first, the scheduler's own
    behaviour). `explore_every`: the losing mode is run once after this many rounds of the winner while the two
    are within 10%, once per `explore_every` more for every further 10% between them (at most 4x as rarely: a
    clear loser is unlikely to overtake soon, and each retry costs its gap), and twice as rarely again after each
    retry that lost (at most 8x in all; a retry that wins resets it): at 8 requests a retry of drafting costs a
    catch-up round and a drafting round ~50% slower than plain ones, and a batch spends most of its rounds there
    (session 18). `keep`: the weight of the past in
    the moving averages, per round of either mode (0.9: about the last 10 rounds count). `share`: a number of
    requests R not seen yet starts from the nearest R' measured in both modes with |R - R'| <= max(1, share * R'),
    its tokens scaled by R / R' (so the same mode wins), instead of measuring both modes afresh: requests of a
    batch finish at different rounds, and its tail (7, 6, 5, ... running) spent most of its few rounds at each R
    measuring (session 15, bench load); a borrowed choice is retried after `explore_every` rounds; 0: never
    borrowed. `margin`: plain decoding must measure this much faster before drafting stops. Drafting is the
    scheduler's own choice, and at one request a drafting round commits 1 to γ + 1 tokens where a plain round
    commits 1, so a short unlucky run of drafts would otherwise switch drafting off until the next retry
    (session 15, bench load at one request: the gate without a margin, on committed tokens, cost 16% against
    no gate). The margin shrinks as 1/sqrt(R) with R running requests: a round's tokens sum over R requests, so
    their noise does, and at 8 requests a 10% margin kept drafting in 16 of 94 rounds where plain decoding measured
    18% faster (session 17, bench load --gate-trace)."""

    min_rounds: int = 3
    explore_every: int = 16
    keep: float = 0.9
    margin: float = 0.1
    share: float = 0.25
    rates: dict[int, dict[bool, _Rate]] = field(default_factory=dict)
    since_other: dict[int, int] = field(default_factory=dict)
    lost_retries: dict[int, int] = field(default_factory=dict)  # retries of the loser in a row that lost again
    trying: dict[int, bool] = field(default_factory=dict)  # a mode retried, kept until one round of it is recorded
    trace: list[dict] | None = None  # every round, measured or not, when a list is given (bench load --gate-trace)

    def __post_init__(self) -> None:
        if self.min_rounds < 1 or self.explore_every < 1:
            raise DsparkError("the draft gate needs min_rounds >= 1 and explore_every >= 1")
        if not 0.0 <= self.keep < 1.0:
            raise DsparkError(f"the draft gate's keep must be in [0, 1), got {self.keep}")
        if not self.margin >= 0.0:
            raise DsparkError(f"the draft gate's margin must be >= 0, got {self.margin}")
        if not self.share >= 0.0:
            raise DsparkError(f"the draft gate's share must be >= 0, got {self.share}")

    def _rates(self, num_requests: int) -> dict[bool, _Rate]:
        """This number of requests' averages; one with nothing of its own yet borrows again each time it is
        asked (a neighbour may have been measured since: a batch's first round at R - 1, its last request still
        in prefill, comes before any round at R, and would otherwise measure both modes on every batch)."""
        rates = self.rates.get(num_requests)
        if rates is None or not any(rate.rounds or rate.borrowed for rate in rates.values()):
            self.rates[num_requests] = rates = self._borrow(num_requests)
        return rates

    def _measured(self, num_requests: int) -> bool:
        """Measured in both modes at this number of requests itself (only such a one lends its averages)."""
        return all(rate.rounds >= self.min_rounds for rate in self.rates[num_requests].values())

    def _borrow(self, num_requests: int) -> dict[bool, _Rate]:
        """Fresh averages for a number of requests, started from the nearest one measured in both modes (the
        larger on a tie: a batch's tail comes down from it) when one is near enough; else empty."""
        near = [r for r in self.rates
                if self.share > 0 and self._measured(r) and abs(r - num_requests) <= max(1, self.share * r)]
        if not near:
            return {True: _Rate(), False: _Rate()}
        lender = min(near, key=lambda r: (abs(r - num_requests), -r))
        rates = self.rates[lender]
        self.since_other[num_requests] = self.explore_every * (self._spacing(rates) - 1)  # retried explore_every on
        return {mode: rate.scaled(num_requests / lender) for mode, rate in rates.items()}

    def _spacing(self, rates: dict[bool, _Rate], lost: int = 0) -> int:
        """Rounds between retries of the loser, in units of explore_every: the further apart, the rarer, and
        doubled by each retry in a row that lost."""
        draft, plain = rates[True].throughput, rates[False].throughput
        gap = max(draft, plain) / max(min(draft, plain), 1e-9) - 1.0
        return min(8, min(4, 1 + int(gap / 0.1)) * 2 ** lost)

    def should_draft(self, num_requests: int, measured: bool = True) -> bool:
        """Whether the next round with `num_requests` running requests drafts. `measured`: whether the engine
        will record the round (False: it carries a prompt chunk); a round that cannot measure is not spent on
        measuring or retrying a mode, it takes the best one known (drafting while neither is known)."""
        rates = self._rates(num_requests)
        if not measured:
            settled = {mode: rate.settled(self.min_rounds) for mode, rate in rates.items()}
            if all(settled.values()):
                return self._drafting_wins(rates, num_requests)
            return settled[True] or not settled[False]  # plain decoding only if only it has an estimate
        for mode in (True, False):  # measure drafting first, then plain decoding
            if not rates[mode].settled(self.min_rounds):
                return mode
        if num_requests in self.trying:  # the engine may not record a round (a prefill, a catch-up): try again
            return self.trying[num_requests]
        best = self._drafting_wins(rates, num_requests)
        spacing = self._spacing(rates, self.lost_retries.get(num_requests, 0))
        if self.since_other.get(num_requests, 0) >= self.explore_every * spacing:
            self.trying[num_requests] = not best
            return not best
        return best

    def _drafting_wins(self, rates: dict[bool, _Rate], num_requests: int) -> bool:
        return rates[True].throughput * (1.0 + self.margin / math.sqrt(num_requests)) >= rates[False].throughput

    def record(self, num_requests: int, drafted: bool, tokens: float, seconds: float) -> None:
        """One decode round: whether it drafted, the tokens it committed (or expected to: the engine passes the
        confidences' expectation, `engine.expected_tokens`), its wall time."""
        if seconds <= 0:
            return
        rates = self._rates(num_requests)
        chosen = all(rate.settled(self.min_rounds) for rate in rates.values())  # not a measuring round
        best = self._drafting_wins(rates, num_requests)
        now = rates[True].rounds + rates[False].rounds + 1  # this round's number among R's recorded rounds
        rates[drafted].add(tokens, seconds, self.keep, now)
        if self.trace is not None:
            self.trace.append({"num_requests": num_requests, "drafted": drafted, "tokens": round(tokens, 4),
                               "seconds": round(seconds, 6), "chosen": chosen})
        if self.trying.get(num_requests) == drafted:  # a retry's round: did the loser lose again?
            del self.trying[num_requests]
            lost = self._drafting_wins(rates, num_requests) != drafted
            self.lost_retries[num_requests] = min(3, self.lost_retries.get(num_requests, 0) + 1) if lost else 0
        self.since_other[num_requests] = self.since_other.get(num_requests, 0) + 1 if chosen and drafted == best else 0

    def unmeasured(self, num_requests: int, drafted: bool, reason: str, seconds: float) -> None:
        """A round the engine does not let the gate judge by (a prefill, a catch-up, lookup drafts only): only
        traced, so a trace shows where the time its averages do not see goes."""
        if self.trace is not None:
            self.trace.append({"num_requests": num_requests, "drafted": drafted, "seconds": round(seconds, 6),
                               "unmeasured": reason})

    def summary(self) -> dict[int, dict[str, float]]:
        """Measured tokens/s by number of requests, drafting and not (for logs and benchmark reports)."""
        return {r: {"draft": round(m[True].throughput, 2), "plain": round(m[False].throughput, 2),
                    "draft_rounds": m[True].rounds, "plain_rounds": m[False].rounds}
                for r, m in sorted(self.rates.items())}
