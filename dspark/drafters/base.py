"""The one interface every drafter implements.

A round: the engine holds `context` = every committed token, the last one being the *anchor*
(emitted by the target but not yet run through it). The drafter proposes up to `num_tokens`
continuations of the anchor. After verification the engine calls `commit` with the target's hidden
states of the positions that have just entered the target's KV cache (anchor + accepted drafts), so
feature-based drafters (DSpark, EAGLE-3, MTP) can grow their own context cache incrementally.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from dspark.sampling import SamplingParams


@dataclass
class Draft:
    """tokens (l,) long; q (l, V) the processed distributions the tokens were sampled from, or None
    for deterministic drafts (one-hot); confidence (l,) per-position conditional survival c_k."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.q is not None and self.q.shape[0] != self.tokens.shape[0]:
            raise ValueError(f"q has {self.q.shape[0]} rows for {self.tokens.shape[0]} draft tokens")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def truncate(self, length: int) -> "Draft":
        return Draft(
            self.tokens[:length],
            None if self.q is None else self.q[:length],
            None if self.confidence is None else self.confidence[:length],
        )

    @property
    def survival(self) -> torch.Tensor | None:
        """a_k = prod_{i<=k} c_i, the estimated probability that drafts 1..k all survive."""
        return None if self.confidence is None else self.confidence.cumprod(0)

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "Draft":
        return Draft(torch.empty(0, dtype=torch.long, device=device))


class Drafter(ABC):
    """Stateless model + per-request state objects, so one drafter can serve many requests."""

    #: DeepSpec convention: id L = output of target layer L (0-based), -1 = embeddings.
    target_layer_ids: tuple[int, ...] = ()
    #: vocabulary the drafter emits ids from; None = any (n-gram copies ids from the context).
    vocab_size: int | None = None
    #: most tokens one proposal can hold (block size); None = unbounded.
    max_block_size: int | None = None

    def start(self, prompt_ids: torch.Tensor, prompt_hidden: torch.Tensor | None) -> Any:
        """Per-request state, given the prompt and the target's features of all prompt positions."""
        return None

    @abstractmethod
    def propose(
        self,
        state: Any,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        """Up to `num_tokens` draft tokens continuing `context` (1-D, last element = anchor).

        Sampled drafters must sample with `sampling` (greedy when temperature is 0) and return as q
        exactly the distributions they sampled from.
        """

    def propose_batch(
        self,
        states: list[Any],
        contexts: list[torch.Tensor],
        num_tokens: list[int],
        samplings: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[Draft]:
        """Drafts for several requests at once; drafters that can batch their forward override this."""
        return [self.propose(*args) for args in zip(states, contexts, num_tokens, samplings, generators, strict=True)]

    def commit(self, state: Any, committed_hidden: torch.Tensor | None) -> None:
        """Target features (n, D) of the positions that just entered the target cache."""

    def compiled(self) -> "Drafter":
        """This drafter drafting through `torch.compile`d forwards where it has them (`--compile`): another drafter
        on the same model, whose per-request states are this one's; itself where nothing compiles."""
        return self

    def warm_up(self) -> int:
        """Compile what `compiled()` compiles before a request needs it; returns how many calls ran compiled."""
        return 0

    @property
    def drafts_compiled(self) -> bool:
        """Whether proposals run a compiled forward (`compiled()`): they cost another price."""
        return False

    def drafts_for_free(self, state: Any, context: torch.Tensor) -> bool:
        """Whether the next proposal for this request runs no model (a context lookup): a scheduler that plans
        who drafts then lets such a request draft whatever it planned. Decided from committed tokens only."""
        return False

    def pending_positions(self, state: Any) -> int:
        """Committed positions whose target features the drafter has not absorbed yet (a lazy commit): its next
        model proposal pays for them first. A round that catches up on many is no measure of a drafting round."""
        return 0


class NoDrafter(Drafter):
    """Vanilla decoding: every round verifies zero drafts and emits one target token."""

    max_block_size = 0

    def propose(self, state, context, num_tokens, sampling, generator) -> Draft:
        return Draft.empty(context.device)
