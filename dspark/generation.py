"""The speculative decoding loop at batch size 1: draft -> verify -> commit, one round at a time.

With `NoDrafter` every round verifies nothing and emits one target token, which is exactly vanilla
decoding — so vanilla and speculative generation share one code path.
"""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from dspark.drafters.base import Draft, Drafter
from dspark.sampling import SamplingParams, next_token
from dspark.target import Target
from dspark.verify import emitted_tokens, verify


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


def speculative_decode(
    target: Target,
    drafter: Drafter,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    block_size: int,
    eos_token_ids: frozenset[int] = frozenset(),
    stats: GenerationStats | None = None,
    schedule: Callable[[Draft], int] | None = None,
) -> Iterator[list[int]]:
    """Yield the newly committed tokens of each round (the first chunk comes from the prefill).

    Stops after an EOS token (which is yielded, as HF `generate` returns it) or `max_new_tokens`.
    `schedule(draft) -> l` decides from the draft's confidences how many drafts to verify (the
    scheduler sees only this round's drafts and confidences, never the target's answer).
    """
    stats = stats if stats is not None else GenerationStats()
    stats.num_prompt_tokens = int(prompt_ids.shape[0])
    start = time.perf_counter()
    prefill = target.prefill(prompt_ids)
    state = drafter.start(prompt_ids, prefill.hidden)
    anchor = next_token(prefill.logits[-1], sampling, generator)
    context = torch.cat([prompt_ids.cpu(), torch.tensor([anchor])])
    stats.prefill_time = time.perf_counter() - start
    stats.num_generated = 1
    stats.finish_reason = "stop" if anchor in eos_token_ids else "length"
    stats.total_time = time.perf_counter() - start
    yield [anchor]

    while stats.num_generated < max_new_tokens and anchor not in eos_token_ids:
        round_start = time.perf_counter()
        budget = min(block_size, max_new_tokens - stats.num_generated - 1)
        draft = drafter.propose(state, context, budget, sampling, generator) if budget > 0 else Draft.empty()
        draft = draft.truncate(budget)
        if schedule is not None and len(draft) and draft.confidence is not None:
            draft = draft.truncate(schedule(draft))
        drafted = time.perf_counter()

        cached = target.length  # == len(context) - 1: everything before the anchor
        verified = target.extend(torch.cat([torch.tensor([anchor]), draft.tokens.cpu()]))
        verdict = verify(draft.tokens.cpu(), draft.q, verified.logits, sampling, generator)
        target.rollback(cached + 1 + verdict.num_accepted)
        drafter.commit(state, None if verified.hidden is None else verified.hidden[: 1 + verdict.num_accepted])
        verified_at = time.perf_counter()

        new_tokens = emitted_tokens(draft.tokens.cpu(), verdict)
        for i, token in enumerate(new_tokens):
            if token in eos_token_ids:
                new_tokens = new_tokens[: i + 1]
                stats.finish_reason = "stop"
                break
        new_tokens = new_tokens[: max_new_tokens - stats.num_generated]
        anchor = new_tokens[-1]
        context = torch.cat([context, torch.tensor(new_tokens)])
        stats.record_round(len(draft), verdict.num_accepted)
        stats.num_generated += len(new_tokens)
        stats.draft_time += drafted - round_start
        stats.verify_time += verified_at - drafted
        stats.total_time = time.perf_counter() - start
        yield new_tokens

