"""Llama/Qwen building blocks shared by the drafters: RMSNorm, RoPE, SwiGLU MLP, target layer shape."""

from typing import Any

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


def target_layer_shape(text_config: Any) -> dict:
    """Layer shape of a target's (text) config, so a drafter layer matches the target's width."""
    heads = int(text_config.num_attention_heads)
    rope = getattr(text_config, "rope_parameters", None) or {}
    return dict(
        hidden_size=int(text_config.hidden_size),
        intermediate_size=int(text_config.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads),
        rms_norm_eps=float(getattr(text_config, "rms_norm_eps", None) or 1e-6),
        rope_theta=float(rope.get("rope_theta") or getattr(text_config, "rope_theta", None) or 10000.0),
    )
