"""Training-time attention of DSpark blocks, without the dense block mask.

In training every anchor a of a sequence contributes one γ-block, and slot k of that block sees the
context positions < a plus the γ slots of its own block. Written as one SDPA call, the keys are
[context (T) ; all blocks (A·γ)] with a (A·γ) × (T + A·γ) boolean mask, almost all of whose block
part is masked out; on a CPU the bf16 SDPA kernel is also far slower than a plain matmul. Here the
scores are computed in two pieces, against the context (anchor-causal mask) and against the own block
(a batched γ × γ product), normalised by one softmax over both, so the result is the same attention
at a fraction of the work.

The blocks are also taken in chunks whose fp32 score tensors stay under `CHUNK_BYTES`, each reading
only the context its latest anchor can see: a (B, H, A·γ, T) score tensor is hundreds of MB per
layer on real batches, and glibc serves anything above 32 MB with a fresh mmap whose pages the kernel
zeroes again on every step (measured: page faults were ~40% of a cached training step).
"""

import math

import torch

#: the largest fp32 score tensor one chunk of blocks may make (glibc's heap serves it below 32 MB)
CHUNK_BYTES = 16 * 2**20


def block_attention(q: torch.Tensor, context_k: torch.Tensor, context_v: torch.Tensor, block_k: torch.Tensor,
                    block_v: torch.Tensor, anchors: torch.Tensor, block_size: int,
                    chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """q (B, H, A·γ, d) block queries; context_k/v (B, H_kv, T, d); block_k/v (B, H_kv, A·γ, d); anchors
    (B, A). Returns (B, H, A·γ, d): slot k of block a attends to context positions < anchors[a] and to
    every slot of block a (GQA: H is a multiple of H_kv)."""
    batch, heads, queries, _ = q.shape
    blocks, length = queries // block_size, context_k.shape[2]
    per_block = batch * heads * block_size * max(length, 1) * 4
    step = max(1, chunk_bytes // per_block)
    if step >= blocks:
        return _attend(q, context_k, context_v, block_k, block_v, anchors, block_size)
    outs = []
    for first in range(0, blocks, step):
        last = min(first + step, blocks)
        rows = slice(first * block_size, last * block_size)
        seen = max(1, min(length, int(anchors[:, first:last].max())))  # no anchor here sees beyond this
        outs.append(_attend(q[:, :, rows], context_k[:, :, :seen], context_v[:, :, :seen], block_k[:, :, rows],
                            block_v[:, :, rows], anchors[:, first:last], block_size))
    return torch.cat(outs, 2)


def _attend(q: torch.Tensor, context_k: torch.Tensor, context_v: torch.Tensor, block_k: torch.Tensor,
            block_v: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    batch, heads, queries, dim = q.shape
    kv_heads, length = context_k.shape[1], context_k.shape[2]
    groups, blocks = heads // kv_heads, queries // block_size
    scale = 1.0 / math.sqrt(dim)
    grouped = q.view(batch, kv_heads, groups, blocks, block_size, dim)
    context_scores = torch.matmul(grouped.flatten(2, 4), context_k.transpose(-1, -2)).float()
    context_scores = context_scores.view(batch, kv_heads, groups, blocks, block_size, length) * scale
    sees = torch.arange(length, device=q.device) < anchors[..., None]  # (B, A, T)
    context_scores = context_scores.masked_fill(~sees[:, None, None, :, None, :], float("-inf"))
    own_k = block_k.view(batch, kv_heads, 1, blocks, block_size, dim)
    block_scores = torch.matmul(grouped, own_k.transpose(-1, -2)).float() * scale  # (B, Hkv, g, A, γ, γ)
    weights = torch.cat([context_scores, block_scores], -1).softmax(-1).to(q.dtype)
    context_weights, block_weights = weights[..., :length], weights[..., length:]
    out = torch.matmul(context_weights.flatten(2, 4), context_v).view(batch, kv_heads, groups, blocks,
                                                                      block_size, dim)
    out = out + torch.matmul(block_weights, block_v.view(batch, kv_heads, 1, blocks, block_size, dim))
    return out.reshape(batch, heads, queries, dim)
