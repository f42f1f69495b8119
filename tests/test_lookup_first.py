"""Lookup-first drafting (`+ngram`): prompt lookup where the context repeats, the model drafter elsewhere.
Greedy output equals HF greedy, sampled output follows the target (chi-square, both kinds of round really
used), and the per-request precision estimate counts exactly what the emitted text showed."""

import pytest
import test_dspark_lossless as lossless
import torch
from stats_helpers import chi_square_pvalue
from test_dspark_lossless import ALPHA, PROMPT, dspark_drafter, exact_marginals, sample_first_tokens

from dspark.drafters.lookup_first import PRIOR_HITS, PRIOR_MISSES, LookupFirstDrafter, LookupFirstState
from dspark.generation import speculative_decode
from dspark.sampling import SamplingParams
from dspark.target import Target

small_target = lossless.small_target  # the same module-scoped tiny target


class Counting(LookupFirstDrafter):
    """Counts the rounds each side drafted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lookup_rounds = self.model_rounds = 0

    def propose_batch(self, states, contexts, num_tokens, samplings, generators):
        drafts = super().propose_batch(states, contexts, num_tokens, samplings, generators)
        for state, context in zip(states, contexts, strict=True):
            lookup = state.pending is not None and state.pending_at == len(context)  # set this round
            self.lookup_rounds += int(lookup)
            self.model_rounds += int(not lookup)
        return drafts


def test_the_precision_counts_the_positions_the_text_showed():
    state = LookupFirstState(None)
    assert state.precision == pytest.approx(PRIOR_HITS / (PRIOR_HITS + PRIOR_MISSES))
    context = torch.tensor([5, 6, 7])
    state.pending, state.pending_at = torch.tensor([1, 2, 3, 4]), 3
    state.observe(torch.cat([context, torch.tensor([1, 2, 9])]))  # 2 right, then the target disagreed
    assert (state.hits, state.misses) == (PRIOR_HITS + 2, PRIOR_MISSES + 1) and state.pending is None
    state.pending, state.pending_at = torch.tensor([8, 8, 8]), 6
    state.observe(torch.tensor([5, 6, 7, 1, 2, 9, 8, 8]))  # 2 right, the third not yet shown: no miss
    assert (state.hits, state.misses) == (PRIOR_HITS + 4, PRIOR_MISSES + 1)
    state.observe(torch.tensor([5, 6, 7, 1, 2, 9, 8, 8, 0]))  # nothing pending: nothing changes
    assert (state.hits, state.misses) == (PRIOR_HITS + 4, PRIOR_MISSES + 1)


def test_lookup_where_the_context_repeats_the_model_elsewhere(small_target):
    model = dspark_drafter(small_target, 4, "vanilla")
    drafter = LookupFirstDrafter(model, min_ngram=3, max_ngram=3)
    target = Target(small_target, model.target_layer_ids)
    repeated = torch.tensor([3, 7, 1, 12, 5, 9, 3, 7, 1])  # the suffix 3 7 1 occurred before, then 12 5 9
    fresh = torch.tensor([3, 7, 1, 12, 5, 9, 2, 4, 6])
    drafts = []
    for context in (repeated, fresh):
        hidden = target.prefill(context[:-1]).hidden
        state = drafter.start(context[:-1], hidden)
        assert drafter.drafts_for_free(state, context) == (context is repeated)  # a lookup hit runs no model
        drafts.append(drafter.propose(state, context, 4, SamplingParams(), None))
        if context is fresh:
            reference = model.propose(model.start(context[:-1], hidden), context, 4, SamplingParams(), None)
    assert drafts[0].tokens.tolist() == [12, 5, 9, 3] and drafts[0].q is None
    assert drafts[0].confidence.tolist() == pytest.approx([PRIOR_HITS / (PRIOR_HITS + PRIOR_MISSES)] * 4)
    assert torch.equal(drafts[1].tokens, reference.tokens)
    assert torch.allclose(drafts[1].confidence, reference.confidence)


@pytest.mark.parametrize("block_size", [1, 4, 7])
def test_greedy_equals_hf(small_target, block_size):
    drafter = Counting(dspark_drafter(small_target, block_size, "vanilla"), min_ngram=1, max_ngram=3)
    with torch.inference_mode():
        reference = small_target.generate(PROMPT[None], attention_mask=torch.ones_like(PROMPT[None]),
                                          max_new_tokens=30, do_sample=False)[0, PROMPT.shape[0]:].tolist()
    chunks = speculative_decode(Target(small_target, drafter.target_layer_ids), drafter, PROMPT, max_new_tokens=30,
                                sampling=SamplingParams(), generator=None, block_size=block_size)
    assert [t for c in chunks for t in c] == reference
    assert drafter.lookup_rounds and drafter.model_rounds


def algorithm_1(survival, sps, state) -> list[int]:
    """The confidence scheduler on a step-cost curve steep enough that it cuts drafts (lookup ones too)."""
    from dspark.scheduler import SPSTable, dspark_lengths

    return dspark_lengths(survival, SPSTable(tuple(1.0 / (1.0 + 0.1 * b) for b in range(16))))


@pytest.mark.parametrize("scheduler", ["fixed", algorithm_1], ids=["fixed", "algorithm-1"])
def test_sampled_output_follows_target(small_target, scheduler):
    drafter = Counting(dspark_drafter(small_target, 4, "vanilla"), min_ngram=1, max_ngram=3)
    params = SamplingParams(temperature=1.0)
    outputs = sample_first_tokens(small_target, drafter, params, 4000, 4, scheduler=scheduler)
    assert drafter.lookup_rounds > 500 and drafter.model_rounds > 500  # both kinds of round were verified
    marginals = exact_marginals(small_target, params)
    pvalues = [chi_square_pvalue(outputs[:, j], marginals[j]) for j in range(3)]
    assert min(pvalues) > ALPHA, pvalues


def test_plus_ngram_loads_around_a_model_drafter(tiny_on_disk):
    from dspark.drafters import load_drafter
    from dspark.errors import DrafterLoadError
    from dspark.loading import load_target

    target = load_target(str(tiny_on_disk / "target")).model
    drafter = load_drafter(f"{tiny_on_disk / 'drafter'}+ngram", target)
    assert isinstance(drafter, LookupFirstDrafter) and drafter.target_layer_ids == drafter.model.target_layer_ids
    assert drafter.config.enable_confidence_head  # the confidence scheduler still runs
    for spec in ("none+ngram", "ngram+ngram"):
        with pytest.raises(DrafterLoadError, match="completes a model drafter"):
            load_drafter(spec, target)
