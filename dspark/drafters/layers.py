"""Llama/Qwen building blocks shared by the drafters: RMSNorm, RoPE, SwiGLU MLP, target layer shape, and
the attention / decoder layer / K/V cache that the EAGLE-3 and MTP baselines (and their training) share."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Normalise in float32, scale in the input dtype (as Llama/Qwen do)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, N, head_dim) for absolute positions (B, N)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, N, hd); rotate-half convention of Llama/Qwen."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class DraftShape:
    """The fields every drafter config starts with: its layers' width at the target's hidden size, and the
    target's vocabulary (`DraftLayerConfig`, `DSparkConfig`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int


def target_layer_shape(text_config: Any) -> dict:
    """Layer shape of a target's (text) config, so a drafter layer matches the target's width."""
    heads = int(text_config.num_attention_heads)
    rope_parameters = getattr(text_config, "rope_parameters", None) or {}
    return dict(
        hidden_size=int(text_config.hidden_size),
        intermediate_size=int(text_config.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads),
        rms_norm_eps=float(getattr(text_config, "rms_norm_eps", None) or 1e-6),
        rope_theta=float(rope_parameters.get("rope_theta") or getattr(text_config, "rope_theta", None) or 10000.0),
    )


# -- attention and the decoder layer of the EAGLE-3 / MTP baselines ----------------------------

#: attend(q, k, v) -> attention output; q (B, H, T, hd), k/v (B, H_kv, T, hd) of the new positions.
#: The layer code is shared by training and drafting; only this callable differs (causal_attend,
#: TTTAttend for training, KVCache.attend for drafting).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LayerShape(Protocol):
    """What a decoder layer reads of its config (`DraftLayerConfig` has it, as `target_layer_shape` gives it)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x (B, H, T, hd) at absolute positions (T,)."""
    cos, sin = rope_cos_sin(positions.to(x.device)[None], x.shape[-1], theta, x.dtype)
    return apply_rope(x, cos, sin)


class Attention(nn.Module):
    """Llama GQA attention without bias; `input_size` may differ from the output width (EAGLE-3: 2·D)."""

    def __init__(self, config: LayerShape, input_size: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = rope(q, positions, self.rope_theta)
        k = rope(k, positions, self.rope_theta)
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer; `block` takes the (already normalised) attention input separately from
    the residual stream, which is what lets EAGLE-3 widen its attention input to 2·D."""

    def __init__(self, config: LayerShape, attention_input_size: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, attention_input_size or config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def block(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = residual + self.self_attn(x, positions, attend)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        return self.block(self.input_layernorm(h), h, positions, attend)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """HF-style init of our own parameters: normal(0, std) linears, unit norms."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, std=std)
        elif isinstance(sub, RMSNorm):
            nn.init.ones_(sub.weight)


# -- the three `Attend`s: training (causal, TTT) and drafting (K/V cache) ----------------------


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal self-attention over one whole sequence (training forwards)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class KVCache:
    """One request's K/V (1, H_kv, T, hd) of one layer. Grown by doubling; rollback (`crop`) only moves
    `length` back, so dropping a round's draft steps costs nothing."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append the new positions' K/V, then attend: new position i sees cache entries 0..start+i."""
        start, end = self.length, self.length + k.shape[2]
        if self.k is None or end > self.k.shape[2]:
            self.k, self.v = _grown(self.k, k, end, start), _grown(self.v, v, end, start)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        keys, values = self.keys_values()
        query_end = start + 1 + torch.arange(q.shape[2], device=q.device)
        mask = torch.arange(end, device=q.device) < query_end[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _grown(old: torch.Tensor | None, like: torch.Tensor, needed: int, length: int) -> torch.Tensor:
    capacity = max(needed, 2 * (0 if old is None else old.shape[2]), 64)
    new = like.new_empty(like.shape[0], like.shape[1], capacity, like.shape[3])
    if old is not None and length:
        new[:, :, :length] = old[:, :, :length]
    return new


class TTTAttend:
    """Training-time-test attention over a whole sequence, unrolled step by step.

    At step j, position t sees the step-1 K/V of positions <= t (the committed context, as cached at
    inference) plus its own K/V from steps 2..j (its draft chain): causal block + diagonals.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        groups = q.shape[1] // k.shape[1]
        keys = [x.repeat_interleave(groups, 1) for x in self.keys]
        values = [x.repeat_interleave(groups, 1) for x in self.values]
        length, scale = q.shape[2], q.shape[-1] ** -0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        context = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
        chain = [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]
        probs = torch.cat([context, *chain], -1).float().softmax(-1).to(q.dtype)
        out = probs[..., :length] @ values[0]
        for i, value in enumerate(values[1:]):
            out = out + probs[..., length + i : length + i + 1] * value
        return out


def shift_left(input_ids: torch.Tensor, n: int) -> torch.Tensor:
    """input_ids (B, T) moved n places left, padded with 0 (those positions are invalid)."""
    return F.pad(input_ids[:, n:], (0, min(n, input_ids.shape[1])))
