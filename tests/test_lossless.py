"""Statistical losslessness: sampled speculative output follows the target distribution.

Failure probability of each passing check is alpha = 1e-3 per position (seeded, so deterministic)."""

import pytest
import torch
from stats_helpers import MarkovDrafter, position_pvalues, random_tables

from dspark import engine
from dspark.drafters.ngram import NgramDrafter
from dspark.sampling import SamplingParams
from dspark.verify import Verdict

ALPHA = 1e-3
NUM_SAMPLES = 20_000
VOCAB = 8


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                                    SamplingParams(temperature=1.3, top_k=4)], ids=["T1", "T0.7-top-p", "T1.3-top-k"])
def test_sampled_drafts_are_lossless(params):
    target_table, draft_table = random_tables(VOCAB, seed=0)
    pvalues = position_pvalues(target_table, MarkovDrafter(draft_table), params, NUM_SAMPLES, block_size=3)
    assert min(pvalues) > ALPHA, pvalues


def test_deterministic_ngram_drafts_are_lossless():
    target_table, _ = random_tables(VOCAB, seed=1)
    params = SamplingParams(temperature=1.0)
    pvalues = position_pvalues(target_table, NgramDrafter(max_ngram=2), params, NUM_SAMPLES, num_tokens=6)
    assert min(pvalues) > ALPHA, pvalues


def always_accept(draft_tokens, q, target_logits, params, generator):
    """A broken verifier: keeps every draft and samples the bonus from the target."""
    n = draft_tokens.shape[0]
    from dspark.sampling import probabilities, sample

    return Verdict(n, int(sample(probabilities(target_logits[n], params), generator)))


def test_negative_control_always_accept_fails(monkeypatch):
    monkeypatch.setattr(engine, "verify", always_accept)
    target_table, draft_table = random_tables(VOCAB, seed=0)
    pvalues = position_pvalues(target_table, MarkovDrafter(draft_table), SamplingParams(temperature=1.0),
                               NUM_SAMPLES, block_size=3)
    assert pvalues[0] > ALPHA  # the first token comes from the target's prefill, untouched
    assert min(pvalues[1:]) < ALPHA, pvalues


def test_same_seed_same_output():
    target_table, draft_table = random_tables(VOCAB, seed=2)
    from stats_helpers import sample_outputs

    params = SamplingParams(temperature=1.0)
    first = sample_outputs(target_table, MarkovDrafter(draft_table), params, 50, 6, 3, seed=5)
    again = sample_outputs(target_table, MarkovDrafter(draft_table), params, 50, 6, 3, seed=5)
    other = sample_outputs(target_table, MarkovDrafter(draft_table), params, 50, 6, 3, seed=6)
    assert torch.equal(first, again) and not torch.equal(first, other)
