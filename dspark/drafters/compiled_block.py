"""The DSpark drafter's round compiled whole by `torch.compile` (`--compile`, beside the target's `dspark.compiled`).

A drafting round's block forward (the draft layers over the projected context and the γ block slots, the draft LM
head) and, for greedy requests, the sequential head's argmax chain and the confidence logits are a few hundred
small ops. Once the target's verification is compiled, their eager dispatch is a sixth of a round at one request on
a 2-core CPU; compiled with the target's settings (`cpp_wrapper`, weights as frozen module parameters that inductor
packs for oneDNN itself) the round drafts in about two thirds of the time (docs/runtime.md, session 27).

Every shape is a dimension, never a value: the context K/V go in as the caches' whole buffers (one request) or
padded to the longest (several) with a boolean mask, so a context's length and a cache's capacity are no guards.
One request's round also projects the positions committed since its last draft into its cache buffers, in the graph
(several requests' are projected eagerly, in one batched pass, before theirs). Three graphs: one request absorbing
committed positions (one position goes in twice, at the same place: dynamic shapes specialise size 1), one request
with none to absorb (its features were projected when too many waited), several requests. The graph computes every
block position; a request drafting fewer keeps a prefix. A memoryless Markov head's greedy chain reads its biases
from a Vd × Vd transition table made once (128 MiB for the default drafter in bf16), one fused loop a position.
Sampled requests draw from its hidden states and base logits with the eager sequential head (`DSparkDrafter`), so q
stays exactly the distribution each token was drawn from.
"""

import torch
import torch.nn.functional as F
from torch import nn

from dspark.compiled import CompiledRunner
from dspark.drafters.dspark import ContextCache, DSparkModel, padded_context
from dspark.drafters.heads import MarkovHead

#: the largest transition table (Vd × Vd Markov biases) a compiled block precomputes: 128 MiB is the default drafter's
#: 8,192-id vocabulary in bf16; a full 49k vocabulary would take 4.5 GiB, and its chain keeps the rank-r product
MAX_TRANSITION_BYTES = 256 * 2**20


class CompiledBlock(nn.Module):
    """`DSparkModel`'s inference block with dense weights (a copy of the module tree sharing the model's tensors,
    plain `nn.Linear`s where the model has packed ones) and the draft LM head as a frozen parameter."""

    def __init__(self, model: DSparkModel) -> None:
        super().__init__()
        dense = DSparkModel(model.config)
        dense.load_state_dict(model.state_dict(), assign=True)  # the same tensors, no copy
        self.model = dense.to(model.device).eval()
        embed, head = model.embeddings()
        dense.share_embeddings(embed, head)
        weight, bias = model.draft_head(head)
        self.head_weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.head_bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        table = transition_table(model)
        self.transition = None if table is None else nn.Parameter(table, requires_grad=False)

    def forward(self, anchors: torch.Tensor, last_context: torch.Tensor | None, positions: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor,
                pending: torch.Tensor | None = None, pending_positions: torch.Tensor | None = None) -> tuple:
        """For the blocks after anchors (R,) at positions (R, γ), over context K/V per draft layer (R, H, L, hd) that
        mask (R, 1, 1, L + γ) selects: hidden (R, γ, D), base logits (R, γ, Vd), the greedy draft (R, γ) in
        target ids, its confidence logits (R, γ) (None without a confidence head) and the projected context of the
        last absorbed position (D,) or None.

        `pending` (n, F) (one request): target features of positions committed since its last draft, projected and
        written into its cache buffers at `pending_positions` (n,) here, before the block reads them, instead of by
        an eager `extend_contexts` (a sixth of a drafting round at one request, session 31); `last_context` then
        comes from them."""
        model = self.model
        absorbed = None
        if pending is not None:
            context, kvs = model.context_kvs(pending, pending_positions)
            for index, (k, v) in enumerate(kvs):
                keys[index][:, :, pending_positions] = k
                values[index][:, :, pending_positions] = v
            absorbed = context[0, -1]
            last_context = absorbed[None]
        x = model.block_input(anchors, last_context)
        hidden = model.block_hidden(x, positions, list(zip(keys, values, strict=True)), mask)
        base_logits = F.linear(hidden.to(self.head_weight.dtype), self.head_weight, self.head_bias)
        tokens = self.greedy_chain(anchors, hidden, base_logits)
        previous = torch.cat([anchors[:, None], tokens[:, :-1]], 1)
        confidence_logits = model.confidence_logits(hidden, previous)
        return hidden, base_logits, tokens, confidence_logits, absorbed

    def greedy_chain(self, anchors: torch.Tensor, hidden: torch.Tensor, base_logits: torch.Tensor) -> torch.Tensor:
        """The greedy draft (R, γ) in target ids: each position's argmax of U_k plus the sequential head's bias of
        the token before it. With a transition table a position after the first reads its bias as a row of the
        table, in draft ids: one fused gather-add-argmax loop a position instead of an embedding gather, a rank-r
        matmul, the argmax and a d2t gather (7 dependent positions were ~0.8 ms of the block, session 32)."""
        model, head = self.model, self.model.markov_head
        if self.transition is not None:
            draft = (base_logits[:, 0] + head.step(None, anchors, hidden[:, 0])[0]).argmax(-1)
            drafts = [draft]
            for k in range(1, base_logits.shape[1]):
                draft = (base_logits[:, k] + self.transition[draft]).argmax(-1)
                drafts.append(draft)
            return model.to_target_ids(torch.stack(drafts, 1))
        state = None if head is None else head.initial_state(hidden[:, 0])
        prev, tokens = anchors, []
        for k in range(base_logits.shape[1]):
            logits = base_logits[:, k]
            if head is not None:
                bias, state = head.step(state, prev, hidden[:, k])
                logits = logits + bias
            prev = model.to_target_ids(logits.argmax(-1))
            tokens.append(prev)
        return torch.stack(tokens, 1)


def transition_table(model: DSparkModel) -> torch.Tensor | None:
    """Row j: the memoryless Markov head's bias (Vd,) after draft id j, the same rank-r product its `step` takes
    (so the same numbers, up to the matmul's summation order); None for a stateful or gated head, no head, or a
    table over `MAX_TRANSITION_BYTES` (the full vocabulary)."""
    head = model.markov_head
    size = model.draft_vocab_size
    if type(head) is not MarkovHead or size * size * model.dtype.itemsize > MAX_TRANSITION_BYTES:
        return None
    with torch.no_grad():
        previous = model.to_target_ids(torch.arange(size, device=model.device))
        return head.step(None, previous, None)[0].detach()


def block_context(caches: list[ContextCache], num_layers: int, block_size: int,
                  lengths: list[int] | None = None) -> tuple:
    """Keys and values per draft layer and the mask of `caches`' blocks: one request's whole buffers (no slice:
    its length would be a guard), several requests' padded to the longest. `lengths`: the positions each block
    sees (default the caches' lengths; more where the round writes the positions it absorbs first)."""
    lengths = torch.tensor([cache.length for cache in caches] if lengths is None else lengths)
    if len(caches) == 1:
        keys, values = caches[0].keys, caches[0].values
    else:
        keys, values = map(list, zip(*(padded_context(caches, i) for i in range(num_layers)), strict=True))
    width = keys[0].shape[2]
    sees = torch.arange(width + block_size) < lengths[:, None]
    sees[:, width:] = True  # every slot of its own block
    return keys, values, sees[:, None, None].to(keys[0].device)


def compiled_block(model: DSparkModel) -> CompiledRunner:
    """The compiled round of `model`, made once per model: every drafter on it (one per engine) shares it."""
    cache = model.__dict__.setdefault("_dspark_compiled_block", [])
    if not cache:
        cache.append(CompiledRunner(CompiledBlock(model).eval(), "compiled draft"))
    return cache[0]
