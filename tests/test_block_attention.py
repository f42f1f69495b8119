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
