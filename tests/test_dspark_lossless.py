"""A randomly initialised DSpark drafter through the real generation loop on a tiny HF target:
greedy output equals HF greedy, and sampled output follows the exact target distribution
(chi-square on the 1st..3rd emitted tokens, alpha = 1e-3 per position)."""

import pytest
import torch
from stats_helpers import chi_square_pvalue
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.drafters.dspark import DSparkModel
from dspark.drafters.dspark_config import DSparkConfig
from dspark.drafters.dspark_drafter import DSparkDrafter
from dspark.generation import speculative_decode
from dspark.sampling import SamplingParams, probabilities
from dspark.target import Target

VOCAB = 16
ALPHA = 1e-3
PROMPT = torch.tensor([3, 7, 1, 12, 5])


@pytest.fixture(scope="module")
def small_target():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # distinct, not-too-flat next-token distributions
    return model


def dspark_drafter(target_model, block_size: int, head: str | None, seed: int = 1,
                   draft_ids: torch.Tensor | None = None) -> DSparkDrafter:
    """A random drafter; `draft_ids` (target ids) makes it draft over that reduced vocabulary."""
    torch.manual_seed(seed)
    config = DSparkConfig.for_target(target_model.config, num_hidden_layers=1, markov_rank=8, block_size=block_size,
                                     mask_token_id=VOCAB - 1, markov_head_type=head,
                                     draft_vocab_size=None if draft_ids is None else len(draft_ids))
    model = DSparkModel(config)
    if draft_ids is not None:
        model.set_draft_vocab(draft_ids)
    with torch.no_grad():  # random init is near-uniform; give q some shape so rejections really happen
        for parameter in model.parameters():
            parameter.mul_(4.0) if parameter.dim() > 1 else None
    return DSparkDrafter(model, target_model.get_input_embeddings(), target_model.get_output_embeddings())


@torch.inference_mode()
def exact_marginals(model, params: SamplingParams) -> list[torch.Tensor]:
    """Marginals of the 1st, 2nd and 3rd sampled tokens, by enumerating every 1- and 2-token prefix."""
    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        ids = torch.cat([PROMPT.expand(prefixes.shape[0], -1), prefixes], 1)
        return probabilities(model(input_ids=ids).logits[:, -1], params)

    first = next_probs(torch.empty(1, 0, dtype=torch.long))[0]
    second_given = next_probs(torch.arange(VOCAB)[:, None])  # (a, b)
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    third_given = next_probs(pairs).reshape(VOCAB, VOCAB, VOCAB)  # (a, b, c)
    joint_ab = first[:, None] * second_given
    return [first, joint_ab.sum(0), (joint_ab[..., None] * third_given).sum((0, 1))]


def sample_first_tokens(model, drafter, params, num_samples, block_size, seed=0, scheduler="fixed") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    target = Target(model, drafter.target_layer_ids)
    outputs = torch.empty(num_samples, 3, dtype=torch.long)
    for i in range(num_samples):
        tokens: list[int] = []
        chunks = speculative_decode(target, drafter, PROMPT, max_new_tokens=block_size + 2, sampling=params,
                                    generator=generator, block_size=block_size, scheduler=scheduler)
        for chunk in chunks:  # the first round verifies a full block; stop once 3 tokens are out
            tokens.extend(chunk)
            if len(tokens) >= 3:
                break
        chunks.close()
        outputs[i] = torch.tensor(tokens[:3])
    return outputs


@pytest.mark.parametrize("block_size, threshold", [(1, None), (4, None), (7, None), (16, None), (7, 0.4)])
def test_greedy_equals_hf(small_target, block_size, threshold):
    from dspark.scheduler import threshold_lengths

    drafter = dspark_drafter(small_target, block_size, "vanilla")
    scheduler = "fixed" if threshold is None else (lambda survival, sps, state: threshold_lengths(survival, threshold))
    with torch.inference_mode():
        reference = small_target.generate(PROMPT[None], attention_mask=torch.ones_like(PROMPT[None]),
                                          max_new_tokens=30, do_sample=False)[0, PROMPT.shape[0]:].tolist()
    chunks = speculative_decode(Target(small_target, drafter.target_layer_ids), drafter, PROMPT, max_new_tokens=30,
                                sampling=SamplingParams(), generator=None, block_size=block_size, scheduler=scheduler)
    assert [t for c in chunks for t in c] == reference


@pytest.mark.parametrize("block_size, head, params, num_samples", [
    (1, "vanilla", SamplingParams(temperature=1.0), 4000),
    (4, "rnn", SamplingParams(temperature=1.0), 4000),
    (7, "vanilla", SamplingParams(temperature=0.7, top_p=0.9), 4000),
    (16, None, SamplingParams(temperature=0.7, top_p=0.9), 4000),
    (7, "vanilla", SamplingParams(temperature=1.0), 12000),
], ids=["g1-markov-T1", "g4-rnn-T1", "g7-markov-T0.7p0.9", "g16-dflash-T0.7p0.9", "g7-markov-T1-12k"])
def test_sampled_output_follows_target(small_target, block_size, head, params, num_samples):
    drafter = dspark_drafter(small_target, block_size, head)
    outputs = sample_first_tokens(small_target, drafter, params, num_samples, block_size)
    marginals = exact_marginals(small_target, params)
    pvalues = [chi_square_pvalue(outputs[:, j], marginals[j]) for j in range(3)]
    assert min(pvalues) > ALPHA, pvalues


def test_negative_control_wrong_q_fails(small_target, monkeypatch):
    """Field bug: the q handed to the verifier is not the distribution the draft was sampled from
    (here a flattened copy, as when q is recomputed with other temperature/top-p settings). The same
    chi-square test must catch the skew."""
    drafter = dspark_drafter(small_target, 4, "vanilla")
    original = drafter.propose_batch

    def flattened_q(*args):
        drafts = original(*args)
        for draft in drafts:
            flat = draft.q.pow(0.3)
            draft.q = flat / flat.sum(-1, keepdim=True)
        return drafts

    monkeypatch.setattr(drafter, "propose_batch", flattened_q)
    params = SamplingParams(temperature=1.0)
    outputs = sample_first_tokens(small_target, drafter, params, 4000, 4)
    marginals = exact_marginals(small_target, params)
    pvalues = [chi_square_pvalue(outputs[:, j], marginals[j]) for j in range(3)]
    assert pvalues[0] > ALPHA and min(pvalues[1:]) < ALPHA, pvalues


def test_dropped_q_stays_lossless_but_accepts_less(small_target, monkeypatch):
    """Verifying a sampled draft as if it were deterministic (one-hot q) is still exact — the draft is
    independent of the target's coins — but acceptance collapses; stats must show it."""
    from dspark.generation import GenerationStats

    drafter = dspark_drafter(small_target, 4, "vanilla")
    params = SamplingParams(temperature=1.0)

    def tau_over(runs: int) -> float:
        generator = torch.Generator().manual_seed(0)
        stats = GenerationStats()
        accepted = rounds = 0
        for _ in range(runs):
            for _ in speculative_decode(Target(small_target, drafter.target_layer_ids), drafter, PROMPT,
                                        max_new_tokens=20, sampling=params, generator=generator, block_size=4,
                                        stats=stats):
                pass
            accepted += sum(stats.accepted_per_round)
            rounds += stats.num_rounds
            stats = GenerationStats()
        return (accepted + rounds) / rounds

    with_q = tau_over(150)
    original = drafter.propose_batch

    def drop_q(*args):
        drafts = original(*args)
        for draft in drafts:
            draft.q = None
        return drafts

    monkeypatch.setattr(drafter, "propose_batch", drop_q)
    assert tau_over(150) < with_q - 0.05


def test_scheduled_verification_stays_lossless(small_target):
    """Algorithm 1 (with its early stop) cutting each draft by its confidences, on a step-cost curve
    steep enough that the verified length really varies: the output still follows the target."""
    from dspark.scheduler import SPSTable, dspark_lengths

    drafter = dspark_drafter(small_target, 7, "vanilla")
    sps = SPSTable(tuple(1.0 / (1.0 + 0.1 * b) for b in range(16)))
    lengths: list[int] = []

    def scheduler(survival, sps_curve, state) -> list[int]:
        lengths.extend(dspark_lengths(survival, sps))
        return lengths[-1:]

    params = SamplingParams(temperature=1.0)
    outputs = sample_first_tokens(small_target, drafter, params, 4000, 7, scheduler=scheduler)
    assert len(set(lengths)) >= 2  # the scheduler really varied the verified length, draft by draft
    marginals = exact_marginals(small_target, params)
    pvalues = [chi_square_pvalue(outputs[:, j], marginals[j]) for j in range(3)]
    assert min(pvalues) > ALPHA, pvalues


#: 10 of the 16 ids: the target often wants one outside it (greedily 14), the prompt and mask token lie outside
DRAFT_IDS = torch.tensor([0, 1, 2, 3, 4, 6, 8, 9, 11, 13])


def test_draft_vocab_greedy_equals_hf(small_target):
    drafter = dspark_drafter(small_target, 7, "vanilla", draft_ids=DRAFT_IDS)
    with torch.inference_mode():
        reference = small_target.generate(PROMPT[None], attention_mask=torch.ones_like(PROMPT[None]),
                                          max_new_tokens=30, do_sample=False)[0, PROMPT.shape[0]:].tolist()
    assert any(t not in DRAFT_IDS for t in reference)
    chunks = speculative_decode(Target(small_target, drafter.target_layer_ids), drafter, PROMPT, max_new_tokens=30,
                                sampling=SamplingParams(), generator=None, block_size=7)
    assert [t for c in chunks for t in c] == reference


def recorded_drafts(drafter, monkeypatch) -> list:
    """Every Draft the drafter hands to verification, from now on."""
    drafts, original = [], drafter.propose_batch

    def recording(*args):
        out = original(*args)
        drafts.extend(out)
        return out

    monkeypatch.setattr(drafter, "propose_batch", recording)
    return drafts


@pytest.mark.parametrize("block_size, head, params", [
    (4, "vanilla", SamplingParams(temperature=1.0)),
    (7, "rnn", SamplingParams(temperature=0.8, top_k=5)),
], ids=["g4-markov-T1", "g7-rnn-T0.8k5"])
def test_draft_vocab_sampled_output_follows_target(small_target, monkeypatch, block_size, head, params):
    """Drafting over 10 of 16 ids (top-k applied to the 10 draft logits) keeps the output exact: q is the
    draft distribution scattered onto the full vocabulary, zero outside; every draft is a subset token."""
    drafter = dspark_drafter(small_target, block_size, head, draft_ids=DRAFT_IDS)
    drafts = recorded_drafts(drafter, monkeypatch)
    outputs = sample_first_tokens(small_target, drafter, params, 4000, block_size)
    marginals = exact_marginals(small_target, params)
    assert float(marginals[1][~drafter.model.t2d].sum()) > 0.2  # the target often wants an undraftable token
    pvalues = [chi_square_pvalue(outputs[:, j], marginals[j]) for j in range(3)]
    assert min(pvalues) > ALPHA, pvalues

    tokens, q = torch.cat([d.tokens for d in drafts]), torch.cat([d.q for d in drafts])
    assert drafter.model.t2d[tokens].all()
    assert (q[:, ~drafter.model.t2d] == 0).all() and (q[torch.arange(len(tokens)), tokens] > 0).all()
    torch.testing.assert_close(q.sum(-1), torch.ones(len(tokens)))
    if params.top_k:
        assert ((q > 0).sum(-1) <= params.top_k).all()


def test_draft_vocab_negative_control_unmapped_q_fails(small_target, monkeypatch):
    """Field bug: q scattered without the d2t offsets (draft id i placed at target id i) while the token
    itself is mapped correctly. The verifier then divides by the probability of another token, and the
    same chi-square test must catch the skew."""
    drafter = dspark_drafter(small_target, 4, "vanilla", draft_ids=DRAFT_IDS)
    vocab_size = drafter.model.config.vocab_size
    monkeypatch.setattr(drafter.model, "scatter_to_target",
                        lambda probs: torch.nn.functional.pad(probs, (0, vocab_size - probs.shape[-1])))
    params = SamplingParams(temperature=1.0)
    outputs = sample_first_tokens(small_target, drafter, params, 4000, 4)
    marginals = exact_marginals(small_target, params)
    pvalues = [chi_square_pvalue(outputs[:, j], marginals[j]) for j in range(3)]
    assert pvalues[0] > ALPHA and min(pvalues[1:]) < ALPHA, pvalues
