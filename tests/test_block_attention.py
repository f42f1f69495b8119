"""The two-piece block attention equals SDPA with the dense block mask it replaces."""

import torch
import torch.nn.functional as F

from dspark.drafters.block_attention import block_attention
from dspark.drafters.dspark import block_attention_mask


def test_block_attention_equals_masked_sdpa():
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, length, gamma = 2, 4, 2, 8, 13, 3
    anchors = torch.tensor([[0, 4, 9, 12], [2, 3, 7, 11]])
    queries = anchors.shape[1] * gamma
    q = torch.randn(batch, heads, queries, dim)
    context_k, context_v = torch.randn(2, batch, kv_heads, length, dim)
    block_k, block_v = torch.randn(2, batch, kv_heads, queries, dim)
    mask = block_attention_mask(anchors, length, gamma)
    expected = F.scaled_dot_product_attention(q, torch.cat([context_k, block_k], 2), torch.cat([context_v, block_v], 2),
                                              attn_mask=mask, enable_gqa=True)
    out = block_attention(q, context_k, context_v, block_k, block_v, anchors, gamma)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # the first anchor at position 0 sees no context at all: its block still attends to itself
    assert torch.isfinite(out).all()


def test_chunked_block_attention_equals_one_piece_in_values_and_gradients():
    """Small chunks (each reading only the context its anchors see) give the one-piece attention exactly,
    with anchors unsorted and a block at anchor 0; and so do their gradients."""
    torch.manual_seed(1)
    batch, heads, kv_heads, dim, length, gamma = 2, 4, 2, 8, 29, 3
    anchors = torch.tensor([[0, 5, 9, 20, 28, 3, 14], [2, 3, 7, 11, 25, 26, 1]])
    queries = anchors.shape[1] * gamma
    inputs = [torch.randn(batch, heads, queries, dim), *torch.randn(2, batch, kv_heads, length, dim),
              *torch.randn(2, batch, kv_heads, queries, dim)]

    def run(chunk_bytes):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = block_attention(*leaves[:3], *leaves[3:], anchors, gamma, chunk_bytes=chunk_bytes)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out, [leaf.grad for leaf in leaves]

    whole, whole_grads = run(2**30)
    per_block = batch * heads * gamma * length * 4
    for chunk_bytes in (1, per_block, 3 * per_block):  # 1 block, 1 block, 3 blocks per chunk
        out, grads = run(chunk_bytes)
        torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
        for grad, expected in zip(grads, whole_grads, strict=True):
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
