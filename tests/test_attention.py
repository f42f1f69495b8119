"""The matmul attention that replaces SDPA on CPU in bf16/fp16 computes what SDPA computes."""

import pytest
import torch
import torch.nn.functional as F

from dspark.attention import attend, matmul_attention, uses_matmul_attention


def _inputs(dtype, batch=2, heads=6, kv_heads=2, steps=3, length=11):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, steps, 16, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, length, 16, generator=generator).to(dtype)
    v = torch.randn(batch, kv_heads, length, 16, generator=generator).to(dtype)
    return q, k, v


def _masks(batch, heads, steps, length):
    causal = torch.arange(length)[None] <= (length - steps + torch.arange(steps))[:, None]  # (T, L)
    per_row = torch.rand(batch, 1, 1, length, generator=torch.Generator().manual_seed(1)) > 0.3
    per_row[..., 0] = True  # every query sees at least one key
    per_head = torch.rand(batch, heads, steps, length, generator=torch.Generator().manual_seed(2)) > 0.3
    per_head[..., 0] = True
    return [None, causal, causal[None, None].expand(batch, 1, steps, length), per_row, per_head]


@pytest.mark.parametrize("kv_heads", [1, 2, 6])
def test_matmul_attention_equals_sdpa_in_float32(kv_heads):
    q, k, v = _inputs(torch.float32, kv_heads=kv_heads)
    for mask in _masks(2, 6, 3, 11):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != 6)
        torch.testing.assert_close(matmul_attention(q, k, v, mask), expected, atol=1e-5, rtol=1e-5)


def test_matmul_attention_differs_when_the_mask_is_ignored():
    """Negative control: the comparison above can fail (a mask that matters changes the output)."""
    q, k, v = _inputs(torch.float32)
    mask = _masks(2, 6, 3, 11)[-1]
    assert not torch.allclose(matmul_attention(q, k, v, mask), matmul_attention(q, k, v, None), atol=1e-3)


def test_attend_takes_the_matmul_path_only_on_cpu_in_reduced_precision():
    q, k, v = _inputs(torch.bfloat16)
    assert uses_matmul_attention(q) and not uses_matmul_attention(q.float())
    mask = _masks(2, 6, 3, 11)[1]
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(attend(q, k, v, mask).float(), reference, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(attend(q.float(), k.float(), v.float(), mask), reference)
