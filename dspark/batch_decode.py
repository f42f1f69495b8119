"""Offline batched sampling for Llama-family targets: many independent prompts, one static KV cache.

Self-distillation samples hundreds of thousands of answers, so it is throughput-bound. HF `generate`
on a CPU spends most of a batched step outside the matmuls: bf16 SDPA at one query token is ~10x
slower than a grouped matmul here, the dynamic cache concatenates and GQA repeats K/V every step, the
top-p sort covers the whole vocabulary, and finished rows keep being decoded. Here the prompts are
left-padded so every row writes the same cache column, attention is a grouped matmul over a
preallocated cache with a padding mask, and finished rows are dropped once they are an eighth of
the batch. The weights are the HF model's own (fused as in `ragged.py`).
"""

import math

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from dspark.ragged import fuse_layer, half_signed, linear, rms_norm, rotate, supports_ragged
from dspark.sampling import SamplingParams, sample_tokens

PREFILL_ROWS = 8  # rows per prefill attention call: bounds the (rows, heads, T, T) score tensor


class StaticBatch:
    """K/V of a fixed set of rows, (rows, kv_heads, capacity, head_dim) per layer, all rows at the
    same length (left padding); `valid` marks the cache columns that hold real tokens."""

    def __init__(self, model: PreTrainedModel, rows: int, capacity: int) -> None:
        config = model.config
        self.model = model
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.layers = [fuse_layer(layer, self.num_heads, self.num_kv_heads, self.head_dim)
                       for layer in model.model.layers]
        dtype = model.model.embed_tokens.weight.dtype
        shape = (rows, self.num_kv_heads, capacity, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in self.layers]
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool)
        self.length = 0

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` (indices), in that order."""
        self.keys = [k[keep] for k in self.keys]
        self.values = [v[keep] for v in self.values]
        self.valid = self.valid[keep]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Append `tokens` (rows, T) at `positions` (their rotary positions; `real` False for left
        padding) and return the logits of the last column, (rows, V) in float32."""
        inner = self.model.model
        start, size = self.length, tokens.shape[1]
        self.valid[:, start : start + size] = real
        end = start + size
        # one additive mask per forward, shared by every layer: (rows, 1, 1 or groups·T, end)
        bias = torch.zeros(self.valid.shape[0], 1, 1, end).masked_fill_(~self.valid[:, None, None, :end], float("-inf"))
        if size > 1:
            groups = self.num_heads // self.num_kv_heads
            causal = torch.arange(end)[None, :] <= start + torch.arange(size)[:, None]  # (T, end)
            bias = bias.masked_fill(~causal.repeat(groups, 1)[None, None], float("-inf"))
        self._bias = bias
        x = inner.embed_tokens(tokens)
        cos, sin = inner.rotary_emb(x, positions)
        cos, sin = cos[:, :, None], half_signed(sin[:, :, None])  # (rows, T, 1, hd)
        for index, layer in enumerate(self.layers):
            x = x + self._attention(layer, index, x, cos, sin, start, size)
            h = rms_norm(x, layer.post_norm)
            gate, up = linear(h, layer.gate_up).chunk(2, -1)
            x = x + linear(F.silu(gate) * up, layer.down)
        self.length = start + size
        return self.model.get_output_embeddings()(rms_norm(x[:, -1], inner.norm)).float()

    def _attention(self, layer, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   start: int, size: int) -> torch.Tensor:
        rows = x.shape[0]
        qkv = linear(rms_norm(x, layer.input_norm), layer.qkv, layer.qkv_bias)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[..., :q_size].view(rows, size, self.num_heads, self.head_dim)
        k = qkv[..., q_size : q_size + kv_size].view(rows, size, self.num_kv_heads, self.head_dim)
        v = qkv[..., q_size + kv_size :].view(rows, size, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q, k = rms_norm(q, layer.q_norm), rms_norm(k, layer.k_norm)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        end = start + size
        self.keys[index][:, :, start:end] = k.transpose(1, 2)
        self.values[index][:, :, start:end] = v.transpose(1, 2)
        step = PREFILL_ROWS if size > 1 else rows
        out = torch.cat([self._grouped_attention(q[a : a + step], index, slice(a, a + step), start, end)
                         for a in range(0, rows, step)])
        return linear(out.reshape(rows, size, -1), layer.o_proj)

    def _grouped_attention(self, q: torch.Tensor, index: int, rows: slice, start: int, end: int) -> torch.Tensor:
        """q (r, T, H, hd) against cache columns [0, end) of `rows`; GQA without repeating K/V."""
        r, size = q.shape[0], q.shape[1]
        groups = self.num_heads // self.num_kv_heads
        keys, values = self.keys[index][rows, :, :end], self.values[index][rows, :, :end]
        # (r, kv, groups·T, hd): query heads of one K/V head side by side
        grouped = q.view(r, size, self.num_kv_heads, groups, self.head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(r, self.num_kv_heads, groups * size, self.head_dim)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float()
        scores = torch.addcmul(self._bias[rows], scores, scores.new_tensor(1.0 / math.sqrt(self.head_dim)))
        # a left-padding row of a prompt sees nothing: its (unused) output is 0, not NaN
        weights = scores.softmax(-1).nan_to_num_(0.0).to(values.dtype)
        out = torch.matmul(weights, values)  # (r, kv, groups·T, hd)
        out = out.view(r, self.num_kv_heads, groups, size, self.head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(r, size, self.num_heads, self.head_dim)


def supports_batch_decode(model: PreTrainedModel) -> bool:
    """Llama-family models without sliding windows (what `StaticBatch` implements)."""
    return supports_ragged(model) and not getattr(model.config, "sliding_window", None)


class HFBatch:
    """The same interface as `StaticBatch` over any HF causal LM: its own forward and dynamic cache
    (slower on a CPU, but works for every architecture)."""

    def __init__(self, model: PreTrainedModel, mask: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.mask = mask

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.mask = self.mask[keep]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        if self.cache.get_seq_length() > 0:
            self.mask = torch.cat([self.mask, real.long()], dim=1)
        out = self.model(input_ids=tokens, attention_mask=self.mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()


@torch.inference_mode()
def decode_rows(
    model: PreTrainedModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator,
    stop: list[int],
) -> list[list[int]]:
    """Sample from left-padded prompts `ids`/`mask` (rows, T) until each row emits a stop token (kept,
    last) or `max_new_tokens`; the new tokens of every row. Llama-family models run on `StaticBatch`,
    others on their own HF forward."""
    if supports_batch_decode(model):
        batch = StaticBatch(model, ids.shape[0], ids.shape[1] + max_new_tokens)
    else:
        batch = HFBatch(model, mask)
    rows = torch.arange(ids.shape[0])  # original row of each live cache row
    produced: list[list[int]] = [[] for _ in range(ids.shape[0])]
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    stop_ids = torch.tensor(stop, dtype=torch.long)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = batch.forward(ids, positions, mask.bool())
    last = positions[:, -1]
    for step in range(max_new_tokens):
        tokens = sample_tokens(logits, params, generator)
        for row, token, finished in zip(rows.tolist(), tokens.tolist(), done.tolist(), strict=True):
            if not finished:
                produced[row].append(token)
        done |= torch.isin(tokens, stop_ids)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if int(done.sum()) * 8 >= len(rows):
            keep = (~done).nonzero().squeeze(-1)
            batch.select(keep)
            rows, tokens, last, done = rows[keep], tokens[keep], last[keep], done[keep]
        last = last + 1
        logits = batch.forward(tokens[:, None], last[:, None], torch.ones(len(rows), 1, dtype=torch.bool))
    return produced
