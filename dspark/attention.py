"""Attention for the decode-time forwards (the ragged target forward, the drafters' inference).

`attend` is `F.scaled_dot_product_attention` with a boolean mask, except on a CPU in bf16/fp16, where
PyTorch's SDPA kernel is several times slower than two plain matmuls for the few query tokens a decode
round has (measured on a 2-core AVX512-BF16 CPU, 1 query over 300 keys, 9/3 heads: 412 µs vs 110 µs;
`dspark bench ragged` shows what it does to a whole forward). The matmul form computes the scores and
the softmax in float32, the output in the input dtype: the same arithmetic SDPA's math path does.
"""

import torch
import torch.nn.functional as F


def uses_matmul_attention(q: torch.Tensor) -> bool:
    """Whether `attend` takes the matmul path for this query (CPU and a reduced-precision dtype)."""
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, T, hd), k/v (B, KV, L, hd) with H a multiple of KV (grouped-query), mask broadcastable
    to (B, H, T, L), True = attend; returns (B, H, T, hd)."""
    if not uses_matmul_attention(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return matmul_attention(q, k, v, mask)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ / √hd) v with the query heads of one K/V head stacked into one matmul (no K/V copy)."""
    batch, heads, steps, head_dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    grouped = q.reshape(batch, kv_heads, group * steps, head_dim)
    scores = (grouped @ k.transpose(-1, -2)).float().mul_(head_dim ** -0.5)
    scores = scores.view(batch, kv_heads, group, steps, length)
    if mask is not None:
        if mask.ndim == 4:  # (B or 1, H or 1, T, L) -> (B or 1, KV or 1, group or 1, T, L)
            mask = mask.reshape(mask.shape[0], -1 if mask.shape[1] == 1 else kv_heads,
                                1 if mask.shape[1] == 1 else group, *mask.shape[2:])
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1).to(v.dtype).view(batch, kv_heads, group * steps, length)
    return (weights @ v).view(batch, heads, steps, head_dim)
