"""Greedy speculative output must equal HF greedy `generate`, token for token, whatever the drafter."""

import pytest
import torch
from conftest import VOCAB, hf_greedy, tiny_model

from dspark.drafters.base import Draft, Drafter, NoDrafter
from dspark.drafters.draft_lm import DraftLMDrafter
from dspark.drafters.ngram import NgramDrafter
from dspark.generation import GenerationStats, speculative_decode
from dspark.sampling import SamplingParams
from dspark.target import Target


class ScriptedDrafter(Drafter):
    """Knows the reference continuation. mode: oracle (always right), wrong (always wrong) or
    partial (round r gets r mod (n+1) tokens right, so every acceptance length occurs)."""

    def __init__(self, reference: list[int], prompt_length: int, mode: str) -> None:
        self.reference = reference
        self.prompt_length = prompt_length
        self.mode = mode
        self.rounds = 0

    def propose(self, state, context, num_tokens, sampling, generator) -> Draft:
        done = context.shape[0] - self.prompt_length
        truth = self.reference[done : done + num_tokens]
        truth += [1] * (num_tokens - len(truth))
        right = {"oracle": num_tokens, "wrong": 0, "partial": self.rounds % (num_tokens + 1)}[self.mode]
        self.rounds += 1
        tokens = [t if i < right else (t + 1) % VOCAB for i, t in enumerate(truth)]
        return Draft(torch.tensor(tokens, dtype=torch.long))


def eos_ids(model) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    return frozenset() if eos is None else frozenset({eos})


def run(model, drafter, prompt, max_new_tokens, block_size, stats=None):
    target = Target(model, drafter.target_layer_ids)
    chunks = speculative_decode(target, drafter, prompt, max_new_tokens=max_new_tokens, sampling=SamplingParams(),
                                generator=None, block_size=block_size, eos_token_ids=eos_ids(model), stats=stats)
    return [token for chunk in chunks for token in chunk]


@pytest.mark.parametrize("mode", ["oracle", "wrong", "partial"])
def test_greedy_equals_hf(tiny_target, mode):
    prompt = torch.randint(3, VOCAB, (11,), generator=torch.Generator().manual_seed(1))
    reference = hf_greedy(tiny_target, prompt, 40)
    stats = GenerationStats()
    drafter = ScriptedDrafter(reference, prompt.shape[0], mode)
    assert run(tiny_target, drafter, prompt, 40, block_size=5, stats=stats) == reference
    expected_tau = {"oracle": (5.0, 6.0), "wrong": (1.0, 1.0), "partial": (1.5, 4.5)}[mode]
    assert expected_tau[0] <= stats.tau <= expected_tau[1]


@pytest.mark.parametrize("drafter_factory", [NoDrafter, NgramDrafter, lambda: DraftLMDrafter(tiny_model("llama", 7))],
                         ids=["none", "ngram", "draft-lm"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_real_drafters_greedy_equal_hf(drafter_factory, block_size):
    model = tiny_model("llama", seed=3)
    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    reference = hf_greedy(model, prompt, 48)
    assert run(model, drafter_factory(), prompt, 48, block_size) == reference


def test_max_new_tokens_and_eos_are_respected():
    model = tiny_model("qwen3", seed=4)
    prompt = torch.arange(3, 15)
    reference = hf_greedy(model, prompt, 30)
    for limit in (1, 2, 7, 30):
        drafter = ScriptedDrafter(reference, prompt.shape[0], "oracle")
        assert run(model, drafter, prompt, limit, block_size=7) == reference[:limit]
    # force an EOS to appear in an accepted draft: generation must stop right after it, EOS included
    model.generation_config.eos_token_id = reference[5]
    stop_reference = hf_greedy(model, prompt, 30)
    target = Target(model)
    drafter = ScriptedDrafter(reference, prompt.shape[0], "oracle")
    chunks = speculative_decode(target, drafter, prompt, max_new_tokens=30, sampling=SamplingParams(),
                                generator=None, block_size=7, eos_token_ids=frozenset({reference[5]}))
    assert [t for c in chunks for t in c] == stop_reference == reference[: reference.index(reference[5]) + 1]


def test_position_acceptance_counts_are_conditional():
    stats = GenerationStats()
    stats.record_round(num_drafted=4, num_accepted=2)  # positions 1, 2 accepted, 3 rejected, 4 never tried
    stats.record_round(num_drafted=4, num_accepted=4)
    stats.record_round(num_drafted=2, num_accepted=0)
    assert stats.position_attempts == [3, 2, 2, 1]
    assert stats.position_accepts == [2, 2, 1, 1]
    assert stats.tau == pytest.approx((3 + 5 + 1) / 3)
