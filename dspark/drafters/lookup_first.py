"""Prompt lookup where the text repeats itself, the model drafter everywhere else.

Small targets repeat their context a lot. On the default target's own answers (corpus v6, 25 answers per
source, every third position) a suffix of at least 3 tokens that occurred before exists at about half of the
positions, and where it does the tokens that followed it predict the next one 79–90% of the time, against
~0.5 for the DSpark drafter's first position. `LookupFirstDrafter` proposes that continuation whenever such
a match exists and the model's draft otherwise, per request and per round; lookup rounds skip the model's
forward. A lookup draft is deterministic (q is one-hot), so every round stays exactly lossless whichever
drafter made it.

Confidence of a lookup draft: each request keeps a running estimate of how often a lookup draft token is
the one the target then emits, c = hits / (hits + misses) over the positions the emitted text has shown
(the maximum-likelihood geometric survival), starting from a prior; every position of a lookup draft gets
c, so the confidence scheduler still sizes its verification. The estimate reads only emitted tokens, so it
does not depend on how much of a draft the scheduler verified.
"""

from dataclasses import dataclass
from typing import Any

import torch

from dspark.drafters.base import Draft, Drafter
from dspark.drafters.ngram import ngram_lookup
from dspark.sampling import SamplingParams

#: prior pseudo-counts of the lookup's precision: 0.8, worth five observed positions
PRIOR_HITS, PRIOR_MISSES = 4.0, 1.0


@dataclass
class LookupFirstState:
    model_state: Any
    pending: torch.Tensor | None = None  # the last lookup draft, until the emitted text shows its outcome
    pending_at: int = 0  # context length when it was proposed
    hits: float = PRIOR_HITS
    misses: float = PRIOR_MISSES
    lookup: tuple[int, torch.Tensor] | None = None  # (context length, continuation found there), asked twice a round

    @property
    def precision(self) -> float:
        return self.hits / (self.hits + self.misses)

    def observe(self, context: torch.Tensor) -> None:
        """Score the pending lookup draft against the tokens emitted since it was proposed."""
        if self.pending is None:
            return
        emitted = context[self.pending_at :]
        seen = min(len(emitted), len(self.pending))
        agree = (emitted[:seen] == self.pending[:seen]).long()
        hits = int(agree.cumprod(0).sum())
        self.hits += hits
        self.misses += int(hits < seen)
        self.pending = None


class LookupFirstDrafter(Drafter):
    """`model` drafts where `ngram_lookup` finds no suffix of `min_ngram`..`max_ngram` tokens seen before."""

    def __init__(self, model: Drafter, min_ngram: int = 3, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.model = model
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.target_layer_ids = model.target_layer_ids
        self.vocab_size = model.vocab_size
        self.max_block_size = model.max_block_size
        self.config = getattr(model, "config", None)  # the confidence scheduler reads the model's

    def compiled(self) -> "LookupFirstDrafter":
        inner = self.model.compiled()
        return self if inner is self.model else LookupFirstDrafter(inner, self.min_ngram, self.max_ngram)

    def warm_up(self) -> int:
        return self.model.warm_up()

    @property
    def drafts_compiled(self) -> bool:
        return self.model.drafts_compiled

    def start(self, prompt_ids: torch.Tensor, prompt_hidden: torch.Tensor | None) -> LookupFirstState:
        return LookupFirstState(self.model.start(prompt_ids, prompt_hidden))

    def commit(self, state: LookupFirstState, committed_hidden: torch.Tensor | None) -> None:
        self.model.commit(state.model_state, committed_hidden)  # the model's context grows in every round

    def _lookup(self, state: LookupFirstState, context: torch.Tensor) -> torch.Tensor:
        """The continuation of the longest repeated suffix (empty: none), found once per context length (a
        request's context only grows, so its length names it)."""
        if state.lookup is None or state.lookup[0] != context.shape[0]:
            state.lookup = (int(context.shape[0]), ngram_lookup(context, int(context.shape[0]), self.max_ngram,
                                                                self.min_ngram))
        return state.lookup[1]

    def drafts_for_free(self, state: LookupFirstState, context: torch.Tensor) -> bool:
        return bool(len(self._lookup(state, context)))

    def pending_positions(self, state: LookupFirstState) -> int:
        return self.model.pending_positions(state.model_state)

    def propose(self, state, context, num_tokens, sampling: SamplingParams, generator) -> Draft:
        return self.propose_batch([state], [context], [num_tokens], [sampling], [generator])[0]

    def propose_batch(self, states, contexts, num_tokens, samplings, generators) -> list[Draft]:
        drafts: list[Draft | None] = [None] * len(states)
        for i, (state, context, n) in enumerate(zip(states, contexts, num_tokens, strict=True)):
            state.observe(context)
            tokens = self._lookup(state, context)[:n] if n > 0 else context[:0]
            if len(tokens):
                state.pending, state.pending_at = tokens.clone(), int(context.shape[0])
                drafts[i] = Draft(state.pending, None, torch.full((len(tokens),), state.precision))
        rest = [i for i, d in enumerate(drafts) if d is None]
        if rest:
            proposed = self.model.propose_batch([states[i].model_state for i in rest], [contexts[i] for i in rest],
                                                [num_tokens[i] for i in rest], [samplings[i] for i in rest],
                                                [generators[i] for i in rest])
            for i, draft in zip(rest, proposed, strict=True):
                drafts[i] = draft
        return drafts
