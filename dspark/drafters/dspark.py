"""DSpark drafter model: a parallel backbone over the target's features plus a light sequential head.

One round (paper section 3.1): the block [embed(anchor), embed(mask) × (γ-1)] goes through a few
Qwen3-style layers whose queries come from the block and whose keys/values are
[projected target context ; block]; attention inside the block is bidirectional. Slot k gives hidden
h_k and base logits U_k (target's frozen LM head after our own `norm`), and predicts the k-th token
after the anchor. A sequential head then adds a bias that depends on the tokens sampled earlier in
the block, and a confidence head estimates the chance that each draft survives verification.

`DSparkModel` keeps its two forwards side by side, and tests check they compute the same function:
training (`forward_train`: all anchors of a sequence at once, block attention mask) and inference
(`extend_context` / `draft_blocks` over each request's `ContextCache` of the projected context, grown by
the committed positions of each round). Per-request drafting is in `dspark_drafter`, the config in `dspark_config`.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.drafters.block_attention import block_attention
from dspark.drafters.draft_vocab import DraftVocabMixin
from dspark.drafters.dspark_config import DSparkConfig
from dspark.drafters.heads import ConfidenceHead, build_sequential_head, sequential_logits
from dspark.drafters.layers import MLP, RMSNorm, apply_rope, rope_cos_sin


class DSparkAttention(nn.Module):
    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Roped keys and values (B, H_kv, N, hd) of x (B, N, D): block or projected context."""
        batch, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor] | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: "torch.Tensor | BlockLayout | None",
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        if isinstance(mask, BlockLayout):  # training: many blocks, each sees the context before its anchor
            out = block_attention(q, context_kv[0], context_kv[1], k, v, mask.anchors, mask.block_size)
            return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))
        if context_kv is not None:
            k = torch.cat([context_kv[0], k], 2)
            v = torch.cat([context_kv[1], v], 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


@dataclass(frozen=True)
class BlockLayout:
    """The blocks of a training forward: anchors (B, A), each followed by its γ slots. Stands for the
    dense `block_attention_mask` (which tests compare it with) at a fraction of the cost."""

    anchors: torch.Tensor
    block_size: int


class DSparkDecoderLayer(nn.Module):
    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.self_attn = DSparkAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, context_kv, cos, sin, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context_kv, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class ContextCache:
    """One request's K/V of the projected target context, per draft layer. Preallocated and grown by
    doubling, so a round only computes (and copies) the positions committed since the last one."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0
        self.last_context: torch.Tensor | None = None  # (D,) projected context of the last position

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.length:
            return None
        return self.keys[index][:, :, : self.length], self.values[index][:, :, : self.length]

    def reserve(self, end: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device | str) -> None:
        """Room for `end` positions (grown by doubling; a first call allocates): a compiled round writes the
        positions it absorbs into the buffers itself."""
        if end <= self.capacity:
            return
        capacity = max(end, 2 * self.capacity, 64)
        if not self.keys:
            empty = torch.zeros(1, num_kv_heads, 0, head_dim, dtype=dtype, device=device)
            self.keys, self.values = [empty] * num_layers, [empty] * num_layers
        self.keys = [_resized(buf, capacity, self.length) for buf in self.keys]
        self.values = [_resized(buf, capacity, self.length) for buf in self.values]

    def append(self, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        first = kvs[0][0]  # (1, H_kv, n, hd)
        end = self.length + first.shape[2]
        self.reserve(end, len(kvs), first.shape[1], first.shape[3], first.dtype, first.device)
        for i, (k, v) in enumerate(kvs):
            self.keys[i][:, :, self.length : end] = k
            self.values[i][:, :, self.length : end] = v
        self.length = end


def _resized(buf: torch.Tensor, capacity: int, length: int) -> torch.Tensor:
    # zeros, not garbage, past the length: a compiled round attends over the whole buffer under a mask, and a
    # masked NaN would still reach the output (its weight is 0, and 0 · NaN is NaN)
    new = buf.new_zeros(buf.shape[0], buf.shape[1], capacity, buf.shape[3])
    new[:, :, :length] = buf[:, :, :length]
    return new


def block_attention_mask(
    anchor_positions: torch.Tensor, context_length: int, block_size: int
) -> torch.Tensor:
    """(B, 1, A*γ, T + A*γ) bool: a block sees the context strictly before its anchor (what the target
    had processed when the anchor was emitted) and every slot of its own block."""
    num_blocks = anchor_positions.shape[1]
    device = anchor_positions.device
    block_of = torch.arange(num_blocks * block_size, device=device) // block_size
    anchors = anchor_positions[:, block_of]  # (B, A*γ): anchor of each query
    sees_context = torch.arange(context_length, device=device) < anchors[..., None]
    sees_block = (block_of[:, None] == block_of[None, :]).expand(anchors.shape[0], -1, -1)
    return torch.cat([sees_context, sees_block], -1)[:, None]


@dataclass
class DSparkOutput:
    """forward_train results; A = anchors per sequence, γ = block size."""

    logits: torch.Tensor  # (B, A, γ, Vd) U_k + sequential bias (teacher-forced), over the draft vocabulary
    base_logits: torch.Tensor  # (B, A, γ, Vd) U_k
    hidden: torch.Tensor  # (B, A, γ, D) h_k (after `norm`)
    confidence_logits: torch.Tensor | None  # (B, A, γ) uncalibrated; c_k = sigmoid(. / T_k)


class DSparkModel(DraftVocabMixin, nn.Module):
    """Backbone + heads. The target's embedding and LM head are used, not owned: they are neither
    saved, trained nor moved with this module (`share_embeddings`) unless a checkpoint brought its
    own copies (`own_embeddings`).

    With `config.draft_vocab_size` set, buffers `d2t` / `t2d` name the draft vocabulary (`DraftVocabMixin`;
    the first Vd ids until `set_draft_vocab`): logits are over the Vd draft ids, inputs (anchor, mask,
    previous tokens) stay target ids. Call `set_draft_vocab` before training: the Markov W2 rows are
    indexed by draft id and are not reordered with it."""

    def __init__(self, config: DSparkConfig, embed_tokens: nn.Module | None = None,
                 lm_head: nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.last_context_proj = (nn.Linear(config.hidden_size, config.hidden_size, bias=False)
                                  if config.last_context_input else None)
        self.layers = nn.ModuleList(DSparkDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.markov_head = build_sequential_head(
            config.markov_head_type, config.vocab_size, config.markov_rank, config.hidden_size,
            config.draft_vocab_size,
        )
        self.confidence_head = None
        if config.enable_confidence_head:
            extra = config.markov_rank if config.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(config.hidden_size, extra)
        self._shared: tuple[nn.Module, nn.Module] | None = None
        self.init_draft_vocab()
        self.init_weights()
        if embed_tokens is not None or lm_head is not None:
            self.share_embeddings(embed_tokens, lm_head)

    def init_weights(self, std: float = 0.02) -> None:
        """HF-style init (normal(0, std), zero biases, unit norms) of our own parameters only."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    # -- the target's frozen embedding and LM head ---------------------------------------------

    def share_embeddings(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        if embed_tokens is None or lm_head is None:
            raise ValueError("pass both the target's embedding and its LM head")
        self._modules.pop("embed_tokens", None)
        self._modules.pop("lm_head", None)
        self._shared = (embed_tokens, lm_head)  # a plain tuple: not registered as submodules
        self._sliced_head = None

    def own_embeddings(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self._shared = None
        self._sliced_head = None
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head

    @property
    def owns_embeddings(self) -> bool:
        return "embed_tokens" in self._modules

    def embeddings(self) -> tuple[nn.Module, nn.Module]:
        if self.owns_embeddings:
            return self._modules["embed_tokens"], self._modules["lm_head"]
        if self._shared is None:
            raise RuntimeError("DSparkModel has no embedding/LM head: call share_embeddings(...)")
        return self._shared

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # -- draft vocabulary: DraftVocabMixin --------------------------------------------------------

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Base logits U_k (..., Vd) of normed hidden states (..., D): the target's frozen LM head,
        restricted to the draft vocabulary when it is reduced."""
        return self.draft_logits(hidden, self.embeddings()[1])

    # -- backbone ------------------------------------------------------------------------------

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """H_ctx = RMSNorm(W_c [H(l1); ...; H(lm)])."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def block_input(self, anchor_tokens: torch.Tensor, last_context: torch.Tensor | None) -> torch.Tensor:
        """[embed(anchor), embed(mask) × (γ-1)] for anchor_tokens (...,) -> (..., γ, D), each slot plus
        W_a·last_context (..., D) with `last_context_input`."""
        config = self.config
        ids = anchor_tokens.new_full((*anchor_tokens.shape, config.block_size), config.mask_token_id)
        ids[..., 0] = anchor_tokens
        x = self.embeddings()[0](ids).to(self.dtype)
        if self.last_context_proj is not None:
            x = x + self.last_context_proj(last_context.to(self.dtype))[..., None, :]
        return x

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.dtype)

    def block_hidden(self, x: torch.Tensor, positions: torch.Tensor, context_kvs: Sequence, mask) -> torch.Tensor:
        """h_k (after `norm`) of block inputs x at `positions` through the draft layers, each attending to its
        context K/V (or None) under `mask` (a `BlockLayout` in training, a boolean SDPA mask or None)."""
        cos, sin = self.rope(positions)
        for layer, context_kv in zip(self.layers, context_kvs, strict=True):
            x = layer(x, context_kv, cos, sin, mask)
        return self.norm(x)

    def _backbone(self, x, positions, context_kvs, mask) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.block_hidden(x, positions, context_kvs, mask)
        return hidden, self.lm_logits(hidden)

    def confidence_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor | None:
        """Uncalibrated confidence logits (...,) for hidden (..., D) and previous tokens (...,)."""
        if self.confidence_head is None:
            return None
        prev = None
        if self.config.confidence_head_with_markov:
            prev = self.markov_head.prev_embedding(prev_tokens)
        return self.confidence_head(hidden, prev).float()

    def confidence(self, confidence_logits: torch.Tensor,
                   sampling_temperatures: Sequence[float] | None = None) -> torch.Tensor:
        """c_k = sigmoid(logit_k / T_k + b_k) for logits (..., n), n <= γ block positions. With
        `sampling_temperatures` (one per row of a (R, n) batch; 0 = greedy) each row takes the set
        fitted nearest its own sampling temperature; without, the default set."""
        n = confidence_logits.shape[-1]
        if sampling_temperatures is None:
            sets = [(self.config.calibration_temperatures, self.config.calibration_biases)]  # every row
        else:
            sets = [self.config.calibration_for(t) for t in sampling_temperatures]
        if all(t is None and b is None for t, b in sets):
            return torch.sigmoid(confidence_logits)

        def table(values: list, fill: float) -> torch.Tensor:
            rows = torch.tensor([[fill] * n if v is None else v[:n] for v in values],
                                device=confidence_logits.device, dtype=confidence_logits.dtype)
            return rows[0] if sampling_temperatures is None else rows

        temperatures = table([t for t, _ in sets], 1.0)
        biases = table([b for _, b in sets], 0.0)
        return torch.sigmoid(confidence_logits / temperatures + biases)

    def forward_train(
        self,
        context_features: torch.Tensor,
        input_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        prev_tokens: torch.Tensor | None = None,
    ) -> DSparkOutput:
        """All blocks of a batch at once. context_features (B, T, F) target features of every
        position, input_ids (B, T), anchor_positions (B, A). Block of anchor a sees features of
        positions < a, exactly like inference. The sequential and confidence heads are teacher-forced
        on prev_tokens (B, A, γ), by default the sequence itself: slot k's previous token sits at a+k."""
        batch, length = input_ids.shape
        num_blocks, gamma = anchor_positions.shape[1], self.config.block_size
        offsets = torch.arange(gamma, device=input_ids.device)

        context = self.project_context(context_features)
        cos, sin = self.rope(torch.arange(length, device=input_ids.device).expand(batch, length))
        context_kvs = [layer.self_attn.kv(context, cos, sin) for layer in self.layers]

        last_context = None
        if self.last_context_proj is not None:  # H_ctx[a-1]; zero for an anchor with no context
            before = (anchor_positions - 1).clamp_min(0)[..., None].expand(-1, -1, context.shape[-1])
            last_context = context.gather(1, before) * (anchor_positions > 0)[..., None]
        x = self.block_input(input_ids.gather(1, anchor_positions), last_context).flatten(1, 2)
        block_positions = (anchor_positions[..., None] + offsets).flatten(1, 2)
        mask = BlockLayout(anchor_positions, gamma)
        hidden, base_logits = self._backbone(x, block_positions, context_kvs, mask)
        hidden = hidden.view(batch, num_blocks, gamma, -1)
        base_logits = base_logits.view(batch, num_blocks, gamma, -1)

        if prev_tokens is None:
            prev_positions = block_positions.clamp(max=length - 1)  # past the end: masked by the loss
            prev_tokens = input_ids.gather(1, prev_positions).view(batch, num_blocks, gamma)
        logits = sequential_logits(self.markov_head, base_logits, hidden, prev_tokens)
        return DSparkOutput(logits, base_logits, hidden, self.confidence_logits(hidden, prev_tokens))

    def forward(self, context_features, input_ids, anchor_positions, prev_tokens=None) -> DSparkOutput:
        """= forward_train, so DDP/FSDP wrappers (which hook `__call__`) see the training forward."""
        return self.forward_train(context_features, input_ids, anchor_positions, prev_tokens)

    # -- inference -------------------------------------------------------------------------------

    def extend_context(self, cache: ContextCache, features: torch.Tensor) -> None:
        """Append the K/V of n newly committed positions (features (n, F)) to one request's cache."""
        self.extend_contexts([cache], [features])

    def context_kvs(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The projected context (1, n, D) of committed features (n, F) at `positions` (n,) and its roped keys and
        values (1, H_kv, n, hd) per draft layer: what a cache takes in (eagerly here, or in the compiled round)."""
        context = self.project_context(features[None])
        cos, sin = self.rope(positions[None])
        return context, [layer.self_attn.kv(context, cos, sin) for layer in self.layers]

    def extend_contexts(self, caches: list[ContextCache], features: list[torch.Tensor]) -> None:
        """Append each request's newly committed positions (features[i] (n_i, F), n_i > 0) to caches[i], all
        requests in one projection: every step is per position, so rows of several requests stack into one
        matrix product per weight instead of one small product per request and weight (~1 ms a request)."""
        sizes = [int(f.shape[0]) for f in features]
        positions = torch.cat([cache.length + torch.arange(n) for cache, n in zip(caches, sizes, strict=True)])
        context, kvs = self.context_kvs(torch.cat(features).to(self.device), positions.to(self.device))
        start = 0
        for cache, n in zip(caches, sizes, strict=True):
            cache.append([(k[:, :, start : start + n], v[:, :, start : start + n]) for k, v in kvs])
            cache.last_context = context[0, start + n - 1]
            start += n

    def draft_blocks(self, caches: list[ContextCache], anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden (R, γ, D) and base logits (R, γ, Vd) of the blocks after each request's anchor
        (anchors (R,)), each at position cache.length of its own cache. Several requests run as one
        batch: their contexts are padded to the longest and masked."""
        gamma = self.config.block_size
        last_context = None
        if self.last_context_proj is not None:
            zero = torch.zeros(self.config.hidden_size, device=self.device, dtype=self.dtype)
            last_context = torch.stack([zero if c.last_context is None else c.last_context for c in caches])
        x = self.block_input(anchors.to(self.device), last_context)
        lengths = torch.tensor([cache.length for cache in caches], device=self.device)
        positions = lengths[:, None] + torch.arange(gamma, device=self.device)
        if len(caches) == 1:
            context_kvs, mask = [caches[0].layer(i) for i in range(len(self.layers))], None
        else:
            context_kvs = [padded_context(caches, i) for i in range(len(self.layers))]
            sees_context = torch.arange(int(lengths.max()), device=self.device) < lengths[:, None]
            mask = torch.cat([sees_context, sees_context.new_ones(len(caches), gamma)], -1)[:, None, None]
        return self._backbone(x, positions, context_kvs, mask)


def padded_context(caches: list[ContextCache], index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft layer's context K/V of several requests, zero-padded to the longest: (R, H, L, hd)."""
    longest = max(cache.length for cache in caches)
    first_k, first_v = caches[0].keys[index], caches[0].values[index]
    keys = first_k.new_zeros(len(caches), first_k.shape[1], longest, first_k.shape[3])
    values = first_v.new_zeros(len(caches), first_v.shape[1], longest, first_v.shape[3])
    for row, cache in enumerate(caches):
        keys[row, :, : cache.length] = cache.keys[index][0, :, : cache.length]
        values[row, :, : cache.length] = cache.values[index][0, :, : cache.length]
    return keys, values
