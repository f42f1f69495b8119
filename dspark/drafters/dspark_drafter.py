"""The DSpark `Drafter`: per-request state (a `ContextCache`) and drafting — start, commit, propose.

The model (`dspark.drafters.dspark`) gives each request's block of hidden states and base logits; here
the sequential head runs step by step, tokens are sampled and the confidences c_k computed.

Reduced draft vocabulary (EAGLE-3 style, `draft_vocab_size`, see `dspark.drafters.vocab`): U_k and the
sequential bias cover only Vd chosen target ids, draft id i standing for target id i + d2t[i]. The draft
distribution is then *defined* over those Vd ids: temperature, top-k and top-p are applied to the Vd
logits (so top-k keeps the k best draft ids, not the k best of the full vocabulary), the token is drawn
there and mapped to its target id, and the same probabilities, scattered onto the full vocabulary with
zeros elsewhere, are the q handed to verification. Losslessness only needs q to be exactly the
distribution the token was drawn from, which it is; what truncation the draft uses only changes
acceptance, never the output distribution.
"""

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from dspark.drafters.base import Draft, Drafter
from dspark.drafters.compiled_block import block_context, compiled_block
from dspark.drafters.dspark import ContextCache, DSparkModel
from dspark.sampling import SamplingParams, probabilities, sample

#: a request's committed features wait until it next drafts (rounds it does not draft in, as under `none`,
#: dspark-async's skipped rounds or prompt-lookup rounds, then cost the drafter nothing) and then enter its cache
#: together with those of every other drafting request; past this many waiting positions it catches up alone
MAX_PENDING = 512


@dataclass
class DSparkState:
    """Per request: the draft-side K/V of committed positions (`cache`) and the target features of the
    positions committed since, not yet projected into it (`pending`)."""

    cache: ContextCache
    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0


class DSparkDrafter(Drafter):
    def __init__(self, model: DSparkModel, embed_tokens: nn.Module | None = None,
                 lm_head: nn.Module | None = None) -> None:
        if embed_tokens is not None or lm_head is not None:
            model.share_embeddings(embed_tokens, lm_head)
        model.embeddings()  # fail now, not in the first round
        self.model = model.eval()
        self.config = model.config
        self.target_layer_ids = model.config.target_layer_ids
        self.vocab_size = model.config.vocab_size
        self.max_block_size = model.config.block_size
        self.block = None  # the compiled round (`compiled`), shared by every drafter on this model

    def compiled(self) -> "DSparkDrafter":
        view = copy.copy(self)
        view.block = compiled_block(self.model)
        return view

    @property
    def drafts_compiled(self) -> bool:
        return self.block is not None

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Compile the three graphs of the compiled round (one request absorbing committed positions, one with
        none to absorb, several) on made-up contexts; returns how many rounds ran compiled (0 where this drafter is
        not compiled)."""
        if self.block is None:
            return 0
        features = torch.randn(40, self.config.feature_size, generator=torch.Generator().manual_seed(0))
        states = [self.start(torch.zeros(n + 1, dtype=torch.long), features[:n]) for n in (20, 33)]
        contexts = [torch.zeros(n + 1, dtype=torch.long) for n in (20, 33)]
        ran = 0
        for count in (1, 1, 2):  # the first round absorbs its prompt, the second finds none left
            self.propose_batch(states[:count], contexts[:count], [self.config.block_size] * count,
                               [SamplingParams()] * count, [None] * count)
            ran += self.block.failed is None
        return ran

    def start(self, prompt_ids: torch.Tensor, prompt_hidden: torch.Tensor | None) -> DSparkState:
        state = DSparkState(ContextCache())
        self.commit(state, prompt_hidden)
        return state

    def commit(self, state: DSparkState, committed_hidden: torch.Tensor | None) -> None:
        """Check the features now (a wrong target fails in the round that produced them), project them later."""
        if committed_hidden is None:
            raise ValueError(
                "DSpark drafting needs target features: build the Target with "
                f"layer_ids={self.target_layer_ids}"
            )
        if committed_hidden.shape[-1] != self.config.feature_size:
            raise ValueError(
                f"target features have width {committed_hidden.shape[-1]}, the drafter reads "
                f"{self.config.feature_size} (layers {self.target_layer_ids})"
            )
        if committed_hidden.shape[0]:
            state.pending.append(committed_hidden)
            state.num_pending += int(committed_hidden.shape[0])
            if state.num_pending >= MAX_PENDING:
                self.flush([state])

    def pending_positions(self, state: DSparkState) -> int:
        return state.num_pending

    @torch.inference_mode()
    def flush(self, states: list[DSparkState]) -> None:
        """Project every pending feature of `states` into their caches, in one batched pass."""
        waiting = [state for state in states if state.pending]
        if not waiting:
            return
        features = [state.pending[0] if len(state.pending) == 1 else torch.cat(state.pending) for state in waiting]
        self.model.extend_contexts([state.cache for state in waiting], features)
        for state in waiting:
            state.pending, state.num_pending = [], 0

    def propose(
        self,
        state: DSparkState,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        return self.propose_batch([state], [context], [num_tokens], [sampling], [generator])[0]

    @torch.inference_mode()
    def propose_batch(self, states, contexts, num_tokens, samplings, generators) -> list[Draft]:
        """One batched drafter forward for every request, then the sequential head step by step for
        all of them (one (R, r) × (r, Vd) product per step instead of R); each request samples with its
        own parameters and generator.

        Tokens are chosen among the Vd draft ids (argmax, or a draw from `probabilities` of the Vd
        logits) and mapped to target ids; q is those same probabilities scattered onto the full
        vocabulary, so it is exactly the distribution each token was drawn from."""
        model = self.model
        counts = [min(n, self.config.block_size) for n in num_tokens]
        live = [i for i, n in enumerate(counts) if n > 0]
        drafts = [Draft.empty(model.device) for _ in states]
        if not live:
            return drafts
        for i in live:
            held = states[i].cache.length + states[i].num_pending
            if held != contexts[i].shape[0] - 1:
                raise RuntimeError(
                    f"draft cache holds {held} positions but the context before the anchor has "
                    f"{contexts[i].shape[0] - 1}: commit the features of every position that entered the target cache"
                )
        anchors = torch.stack([contexts[i][-1] for i in live]).to(model.device)
        compiled = self._compiled_round([states[i] for i in live], anchors)
        self.flush([states[i] for i in live])  # the eager round's (nothing left where the compiled round absorbed)
        caches = [states[i].cache for i in live]
        longest = max(counts[i] for i in live)
        if compiled is not None and all(samplings[i].greedy for i in live):  # the graph's own argmax chain
            _, _, tokens, confidence_logits, _ = compiled
            tokens, q = tokens[:, :longest], [[] for _ in live]
        else:
            hidden, base_logits = compiled[:2] if compiled is not None else model.draft_blocks(caches, anchors)
            tokens, q = self._sequential(hidden, base_logits, anchors, [counts[i] for i in live],
                                         [samplings[i] for i in live], [generators[i] for i in live])
            prev_tokens = torch.cat([anchors[:, None], tokens[:, :-1]], 1)
            confidence_logits = model.confidence_logits(hidden[:, :longest], prev_tokens)
        confidence = None if confidence_logits is None else model.confidence(
            confidence_logits[:, :longest], [samplings[i].temperature for i in live])  # 0 = greedy
        for row, i in enumerate(live):
            n = counts[i]
            drafts[i] = Draft(tokens[row, :n], model.scatter_to_target(torch.stack(q[row])) if q[row] else None,
                              None if confidence is None else confidence[row, :n])
        return drafts

    def _compiled_round(self, states: list[DSparkState], anchors: torch.Tensor) -> tuple | None:
        """The compiled block's (hidden, base logits, greedy draft, its confidence logits, absorbed last context), or
        None: not compiled, a request with no context yet, or the compile failed (said once; the eager forward then
        drafts). One request absorbs its pending positions in the graph; several are flushed eagerly first, in one
        batched pass."""
        if self.block is None:
            return None
        model, config = self.model, self.config
        pending = positions = None
        if len(states) == 1 and states[0].num_pending:  # absorbed in the graph
            pending, positions = self._pending_input(states[0])
        else:
            self.flush(states)
            if not all(state.cache.length for state in states):
                return None
        caches = [state.cache for state in states]
        lengths = [cache.length + state.num_pending for cache, state in zip(caches, states, strict=True)]
        keys, values, mask = block_context(caches, len(model.layers), config.block_size, lengths)
        starts = torch.tensor(lengths, device=model.device)
        block_positions = starts[:, None] + torch.arange(config.block_size, device=model.device)
        last_context = None
        if model.last_context_proj is not None and pending is None:
            last_context = torch.stack([cache.last_context for cache in caches])
        result = self.block(anchors, last_context, block_positions, keys, values, mask, pending, positions)
        if result is None or pending is None:
            return result
        cache, state = caches[0], states[0]  # the graph wrote the pending positions: take them in
        cache.length, cache.last_context = lengths[0], result[4]
        state.pending, state.num_pending = [], 0
        return result

    def _pending_input(self, state: DSparkState) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's pending features and their positions as the compiled round takes them in, with room for them
        reserved in its cache. In the drafter's dtype, as the projection would cast them anyway: a target of another
        dtype would otherwise be a graph of its own, compiled in the first round rather than by `warm_up`."""
        model, config, cache = self.model, self.config, state.cache
        pending = torch.cat(state.pending).to(model.device, model.dtype)
        positions = cache.length + torch.arange(pending.shape[0], device=model.device)
        cache.reserve(cache.length + state.num_pending, len(model.layers), config.num_key_value_heads,
                      config.head_dim, model.dtype, model.device)
        if pending.shape[0] == 1:  # twice at the same place: a size of 1 would be a graph of its own
            return pending.repeat(2, 1), positions.repeat(2)
        return pending, positions

    def _sequential(self, hidden: torch.Tensor, base_logits: torch.Tensor, anchors: torch.Tensor, counts: list[int],
                    samplings: list[SamplingParams], generators: list) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """The sequential head step by step over rows of blocks: tokens (R, longest count) in target ids, and per
        row the distributions its sampled tokens were drawn from (none for a greedy row)."""
        model = self.model
        head = model.markov_head
        head_state = None if head is None else head.initial_state(hidden[:, 0])
        prev, tokens, q = anchors, [], [[] for _ in counts]
        for k in range(max(counts)):
            logits = base_logits[:, k]
            if head is not None:
                bias, head_state = head.step(head_state, prev, hidden[:, k])
                logits = logits + bias
            choice = logits.argmax(-1)  # draft ids
            for row, sampling in enumerate(samplings):
                if not sampling.greedy and k < counts[row]:  # greedy verification compares tokens only
                    probs = probabilities(logits[row], sampling)
                    choice[row] = sample(probs, generators[row])
                    q[row].append(probs)
            prev = model.to_target_ids(choice)
            tokens.append(prev)
        return torch.stack(tokens, 1), q
