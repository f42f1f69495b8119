"""Batched static-cache decoding (self-distillation) and the shortlist sampler."""

import pytest
import torch
from conftest import hf_greedy, tiny_model

from dspark.batch_decode import decode_rows, supports_batch_decode
from dspark.sampling import SamplingParams, probabilities, sample_tokens
from dspark.train.regenerate import left_pad


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_batched_greedy_equals_hf_greedy_per_prompt(arch):
    model = tiny_model(arch)
    assert supports_batch_decode(model)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=generator).tolist() for n in (5, 9, 2, 7)]
    ids, mask = left_pad(prompts, pad_id=0)
    stop = [7]
    rows = decode_rows(model, ids, mask, 12, SamplingParams(), torch.Generator(), stop)
    for prompt, row in zip(prompts, rows, strict=True):
        expected = hf_greedy(model, torch.tensor(prompt), 12)
        if 7 in expected:
            expected = expected[: expected.index(7) + 1]  # rows stop at (and keep) their stop token
        assert row == expected


def test_gpt2_is_not_batch_decoded():
    assert not supports_batch_decode(tiny_model("gpt2"))


@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_shortlist_sampler_follows_the_nucleus_distribution(top_p):
    """sample_tokens draws from the same distribution as sample(probabilities(...)); total-variation
    bound 0.03 at this sample size (sampling noise is ~0.01; a sampler ignoring top-p is farther)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 2000) * 3
    logits[:, :4] += 6
    params = SamplingParams(temperature=0.8, top_p=top_p)
    p = probabilities(logits, params)
    generator = torch.Generator().manual_seed(1)
    draws = 20000
    counts = torch.zeros_like(p)
    for _ in range(draws // 500):
        tokens = sample_tokens(logits.repeat(500, 1), params, generator).view(500, 3)
        for row in range(3):
            counts[row] += torch.bincount(tokens[:, row], minlength=2000)
    tv = (counts / draws - p).abs().sum(-1) / 2
    assert (tv < 0.03).all(), tv
    assert (counts[p == 0] == 0).all()  # never outside the nucleus
    unrestricted = probabilities(logits, SamplingParams(temperature=0.8))
    assert ((unrestricted - p).abs().sum(-1) / 2 > 0.03).any()  # negative control: ignoring top-p would fail


def test_shortlist_falls_back_when_the_nucleus_is_wide():
    """Near-uniform logits: the top 256 tokens hold < top_p, so the full sort decides."""
    logits = torch.zeros(2, 5000)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    tokens = sample_tokens(logits, params, torch.Generator().manual_seed(0))
    assert tokens.shape == (2,) and (tokens < 5000).all()
    assert torch.equal(sample_tokens(logits + torch.arange(5000.0), SamplingParams(), None),
                       torch.full((2,), 4999))


def test_other_architectures_decode_through_their_own_forward():
    """GPT-2 has no StaticBatch path: the HF fallback gives the same greedy rows as HF generate."""
    model = tiny_model("gpt2")
    prompts = [[5, 9, 11, 3], [7, 8]]
    ids, mask = left_pad(prompts, pad_id=0)
    rows = decode_rows(model, ids, mask, 6, SamplingParams(), torch.Generator(), [])
    assert rows[0] == hf_greedy(model, torch.tensor(prompts[0]), 6)
    assert len(rows[1]) == 6
