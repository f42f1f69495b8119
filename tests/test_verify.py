"""The rejection sampler on hand-made logits."""

import math

import pytest
import torch

from dspark.errors import DsparkError
from dspark.sampling import SamplingParams, probabilities
from dspark.verify import emitted_tokens, verify, verify_greedy, verify_sampled


def peaked(tokens: list[int], vocab: int = 6, height: float = 10.0) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = height
    return logits


def test_greedy_empty_draft_emits_target_argmax():
    verdict = verify_greedy(torch.empty(0, dtype=torch.long), peaked([4]))
    assert (verdict.num_accepted, verdict.next_token) == (0, 4)


def test_greedy_full_accept_gives_bonus():
    verdict = verify_greedy(torch.tensor([1, 2, 3]), peaked([1, 2, 3, 5]))
    assert (verdict.num_accepted, verdict.next_token) == (3, 5)
    assert emitted_tokens(torch.tensor([1, 2, 3]), verdict) == [1, 2, 3, 5]


def test_greedy_first_token_reject_emits_target_choice():
    verdict = verify_greedy(torch.tensor([0, 2, 3]), peaked([1, 2, 3, 5]))
    assert (verdict.num_accepted, verdict.next_token) == (0, 1)


def test_greedy_rejects_after_mismatch_even_if_later_tokens_match():
    verdict = verify_greedy(torch.tensor([1, 0, 3]), peaked([1, 2, 3, 5]))
    assert (verdict.num_accepted, verdict.next_token) == (1, 2)


def test_sampled_full_accept_when_p_equals_q():
    p = torch.softmax(torch.randn(4, 6), -1)
    draft = torch.tensor([0, 1, 2])
    verdict = verify_sampled(draft, p[:3], p, torch.Generator().manual_seed(0))
    assert verdict.num_accepted == 3


def test_sampled_rejects_token_with_zero_target_probability():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    for seed in range(20):
        verdict = verify_sampled(torch.tensor([0]), q, p, torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 0 and verdict.next_token in (1, 2)


def test_recovered_token_follows_residual_distribution():
    """After a rejection the token comes from norm(max(p - q, 0))."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    rejections = 0
    for _ in range(6000):
        verdict = verify_sampled(torch.tensor([0]), q, p, generator)
        if verdict.num_accepted == 0:
            rejections += 1
            counts[verdict.next_token] += 1
    residual = (p[0] - q[0]).clamp_min(0)
    expected = residual / residual.sum()
    assert counts[0] == 0
    assert torch.allclose(counts / rejections, expected, atol=0.03)
    assert abs(rejections / 6000 - (1 - 0.1 / 0.7)) < 0.03  # accept prob of token 0 = p/q = 1/7


def test_one_hot_draft_residual_excludes_draft_token():
    p = torch.tensor([[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    generator = torch.Generator().manual_seed(1)
    outcomes = [verify_sampled(torch.tensor([0]), None, p, generator) for _ in range(4000)]
    accepted = sum(v.num_accepted for v in outcomes) / len(outcomes)
    assert abs(accepted - 0.5) < 0.03
    assert all(v.next_token != 0 for v in outcomes if v.num_accepted == 0)


def test_top_k_and_top_p_truncate_p_and_q_identically():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    top_k = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top_k[0, 2:] == 0).all() and math.isclose(float(top_k.sum()), 1.0, rel_tol=1e-6)
    full = torch.softmax(logits, -1)[0]
    top_p = probabilities(logits, SamplingParams(temperature=1.0, top_p=float(full[0] + 0.01)))
    assert (top_p[0, :2] > 0).all() and (top_p[0, 2:] == 0).all()
    only_first = probabilities(logits, SamplingParams(temperature=1.0, top_p=float(full[0] - 0.01)))
    assert only_first[0, 0] == 1.0
    cold = probabilities(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(cold, torch.softmax(logits / 0.5, -1))


def test_truncated_target_never_emits_tokens_outside_top_k():
    logits = torch.tensor([[3.0, 2.9, 2.8, -1.0], [3.0, 2.9, 2.8, -1.0]])
    params = SamplingParams(temperature=1.0, top_k=2)
    generator = torch.Generator().manual_seed(0)
    q = probabilities(logits[:1], params)
    for _ in range(500):
        verdict = verify(torch.tensor([1]), q, logits, params, generator)
        assert verdict.next_token in (0, 1)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                    dict(temperature=float("nan"))])
def test_invalid_sampling_params_are_refused(kwargs):
    with pytest.raises(DsparkError):
        SamplingParams(**kwargs)
