"""Per-request generation statistics (τ, per-position acceptance, time split) and engine-wide totals."""

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    num_prompt_tokens: int = 0
    num_generated: int = 0
    num_rounds: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    #: position_attempts[k-1]: rounds where draft k was verified with drafts 1..k-1 accepted
    position_attempts: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    finish_reason: str = "length"

    @property
    def tau(self) -> float:
        """Mean tokens emitted per round: accepted drafts + 1 (recovered or bonus)."""
        if not self.num_rounds:
            return 0.0
        return (sum(self.accepted_per_round) + self.num_rounds) / self.num_rounds

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.total_time if self.total_time > 0 else 0.0

    @property
    def other_time(self) -> float:
        return max(0.0, self.total_time - self.prefill_time - self.draft_time - self.verify_time)

    def record_round(self, num_drafted: int, num_accepted: int) -> None:
        self.num_rounds += 1
        self.drafted_per_round.append(num_drafted)
        self.accepted_per_round.append(num_accepted)
        tried = min(num_drafted, num_accepted + 1)
        while len(self.position_attempts) < num_drafted:
            self.position_attempts.append(0)
            self.position_accepts.append(0)
        for k in range(tried):
            self.position_attempts[k] += 1
            self.position_accepts[k] += int(k < num_accepted)

    def to_dict(self) -> dict:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated": self.num_generated,
            "num_rounds": self.num_rounds,
            "tau": round(self.tau, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "position_attempts": self.position_attempts,
            "position_accepts": self.position_accepts,
            "time_s": {
                "total": round(self.total_time, 4),
                "prefill": round(self.prefill_time, 4),
                "draft": round(self.draft_time, 4),
                "verify": round(self.verify_time, 4),
                "other": round(self.other_time, 4),
            },
            "finish_reason": self.finish_reason,
        }


# duplicates: counters, the same shape as each other and as the other counter dataclasses (bench.MethodTally,
# peers.llamacpp.PeerTotals, feature_cache.BuildStats, regenerate.RegenerateStats): different fields — kept apart
@dataclass
class EngineStats:
    """Totals over the engine's life, for /metrics and the load benchmark."""

    num_rounds: int = 0
    num_requests_finished: int = 0
    num_generated: int = 0
    num_prompt_tokens: int = 0
    num_drafted: int = 0
    num_verified: int = 0
    num_accepted: int = 0
    #: Σ over verify rounds of the mean drafts verified per request
    verified_per_request_sum: float = 0.0
    #: rounds in which some prefilled request was verified (drafts or only its anchor)
    verify_rounds: int = 0
    #: Σ over rounds of the number of requests verified in the round
    request_rounds: int = 0
    round_time: float = 0.0
    scheduler_time: float = 0.0

    @property
    def verified_per_request(self) -> float:
        """Mean drafts verified per request per round (reported as the "verification budget")."""
        return self.verified_per_request_sum / self.verify_rounds if self.verify_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_verified if self.num_verified else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per request-round: (accepted + one target token) per verified request."""
        return 0.0 if not self.request_rounds else (self.num_accepted + self.request_rounds) / self.request_rounds
