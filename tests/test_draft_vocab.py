"""Reduced draft vocabulary: selection by corpus frequency, coverage, the d2t/t2d maps, and the model's
helpers (the drafter-level and lossless tests live in test_dspark_drafter.py / test_dspark_lossless.py)."""

import numpy as np
import pytest
import torch
from torch import nn

from dspark.drafters.dspark import DSparkModel
from dspark.drafters.dspark_config import DSparkConfig
from dspark.drafters.vocab import (
    carry_rows,
    check_target_ids,
    count_tokens,
    coverage,
    ids_from_offsets,
    offsets_from_ids,
    select_draft_vocab,
    t2d_mask,
    target_to_draft_map,
)

V = 12


def test_select_most_frequent_ties_by_id_sorted():
    counts = np.array([5, 1, 5, 0, 3, 3, 9, 0, 2, 0, 0, 7])
    ids = select_draft_vocab(counts, 5)
    assert ids.dtype == torch.long and ids.tolist() == [0, 2, 4, 6, 11]  # 9, 7, 5, 5, then 3 (id 4 before 5)
    assert select_draft_vocab(torch.from_numpy(counts), 5).tolist() == ids.tolist()  # numpy or torch
    assert select_draft_vocab(counts, V).tolist() == list(range(V))


def test_select_always_includes_special_tokens():
    counts = np.array([5, 1, 5, 0, 3, 3, 9, 0, 2, 0, 0, 7])
    ids = select_draft_vocab(counts, 5, always=[10, 3, 10])  # never seen, duplicated: still in, once
    assert ids.tolist() == [0, 3, 6, 10, 11]
    with pytest.raises(ValueError, match="do not fit"):
        select_draft_vocab(counts, 2, always=[1, 3, 5])
    with pytest.raises(ValueError, match="always"):
        select_draft_vocab(counts, 5, always=[V])
    for size in (0, V + 1):
        with pytest.raises(ValueError, match="size"):
            select_draft_vocab(counts, size)


def test_coverage_and_counts():
    tokens = torch.tensor([[1, 1, 2, -100], [3, 1, 2, 2]])
    counts = count_tokens(tokens, 5)
    assert counts.tolist() == [0, 3, 3, 1, 0]  # the ignored label is not counted
    assert coverage(counts, torch.tensor([1, 2])) == pytest.approx(6 / 7)
    assert coverage(counts.numpy(), np.array([0, 4])) == 0.0
    assert coverage(counts, select_draft_vocab(counts, 3)) == 1.0
    with pytest.raises(ValueError, match="empty"):
        coverage(np.zeros(4), [1])
    with pytest.raises(ValueError, match="outside"):
        count_tokens(torch.tensor([5]), 5)


def test_carry_rows_keeps_the_rows_of_kept_ids_and_zeros_new_ones():
    rows = torch.arange(12.0).reshape(4, 3)  # draft ids 0..3 = target ids 2, 5, 7, 9
    carried = carry_rows(rows, torch.tensor([2, 5, 7, 9]), torch.tensor([1, 5, 9, 11, 12]))
    assert torch.equal(carried, torch.stack([torch.zeros(3), rows[1], rows[3], torch.zeros(3), torch.zeros(3)]))
    assert torch.equal(carry_rows(rows, torch.tensor([2, 5, 7, 9]), torch.tensor([5, 7])), rows[1:3])
    with pytest.raises(ValueError, match="rows for a vocabulary"):
        carry_rows(rows, torch.tensor([2, 5]), torch.tensor([2]))


def test_eagle3_maps():
    ids = torch.tensor([1, 4, 5, 9])
    d2t = offsets_from_ids(ids)
    assert d2t.tolist() == [1, 3, 3, 6]  # draft id i -> target id i + d2t[i]
    assert torch.equal(ids_from_offsets(d2t), ids)
    assert t2d_mask(ids, V).nonzero().flatten().tolist() == ids.tolist()
    mapping = target_to_draft_map(ids, V)
    assert mapping[ids].tolist() == [0, 1, 2, 3] and (mapping[~t2d_mask(ids, V)] == -1).all()


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([1, 2, 3]), "has 3 ids"),
    (torch.tensor([1, 2, 3, V]), "outside the target vocabulary"),
    (torch.tensor([-1, 2, 3, 4]), "outside the target vocabulary"),
    (torch.tensor([1, 3, 3, 4]), "strictly increasing"),
    (torch.tensor([4, 3, 2, 1]), "strictly increasing"),
    (torch.tensor([1.0, 2.0, 3.0, 4.0]), "integer"),
])
def test_check_target_ids_refuses(ids, message):
    with pytest.raises(ValueError, match=message):
        check_target_ids(ids, 4, V)


def tiny_model(draft_vocab_size: int | None, head="rnn") -> DSparkModel:
    torch.manual_seed(0)
    config = DSparkConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=8, vocab_size=V, num_target_layers=4, mask_token_id=V - 1,
                          target_layer_ids=(1,), num_hidden_layers=1, markov_rank=4, block_size=3,
                          markov_head_type=head, draft_vocab_size=draft_vocab_size)
    return DSparkModel(config, nn.Embedding(V, 16), nn.Linear(16, V, bias=False))


def test_model_draft_vocab_helpers():
    model = tiny_model(4)
    assert model.reduced_vocab and model.draft_vocab_size == 4
    assert model.draft_to_target().tolist() == [0, 1, 2, 3]  # before set_draft_vocab: the first ids
    assert tuple(model.markov_head.markov_w1.weight.shape) == (V, 4)  # previous token: any target id
    assert tuple(model.markov_head.markov_w2.weight.shape) == (4, 4)  # bias: draft ids only
    model.set_draft_vocab(torch.tensor([9, 1, 5, 4]))  # any order; stored sorted
    assert model.d2t.dtype == torch.long and model.d2t.tolist() == [1, 3, 3, 6]
    assert model.t2d.dtype == torch.bool and model.t2d.nonzero().flatten().tolist() == [1, 4, 5, 9]
    assert model.target_to_draft().tolist() == [-1, 0, -1, -1, 1, 2, -1, -1, -1, 3, -1, -1]
    assert model.to_target_ids(torch.tensor([[3, 0]])).tolist() == [[9, 1]]
    assert model.to_draft_ids(torch.tensor([9, 2, -100, 4])).tolist() == [3, -1, -1, 1]
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    full = model.scatter_to_target(probs)
    assert full.shape == (1, V) and full[0, [1, 4, 5, 9]].tolist() == probs[0].tolist() and full.sum() == 1
    for bad in (torch.tensor([1, 1, 2, 3]), torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3, V])):
        with pytest.raises(ValueError):
            model.set_draft_vocab(bad)
    assert model.d2t.tolist() == [1, 3, 3, 6]  # a refused vocabulary changes nothing
    with pytest.raises(ValueError, match="full vocabulary"):
        tiny_model(None).set_draft_vocab(torch.arange(4))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        tiny_model(V + 1)


def test_full_vocab_model_is_unchanged():
    model = tiny_model(None)
    assert not model.reduced_vocab and model.draft_vocab_size == V
    assert "d2t" not in model.state_dict() and "t2d" not in model.state_dict()
    assert tuple(model.markov_head.markov_w2.weight.shape) == (V, 4)
    probs = torch.rand(2, V)
    assert model.scatter_to_target(probs) is probs
    assert model.to_draft_ids(torch.tensor([3, -100])).tolist() == [3, -1]


@pytest.mark.parametrize("head", ["vanilla", None])
def test_reduced_logits_are_the_sliced_lm_head(head):
    """U_k over the draft ids equals the full LM head's logits at those ids; the slice is cached and
    follows set_draft_vocab and a change of LM head, and is not part of the state dict."""
    model = tiny_model(5, head)
    model.set_draft_vocab(torch.tensor([0, 2, 3, 7, 10]))
    hidden = torch.randn(2, 3, 16)
    lm_head = model.embeddings()[1]
    torch.testing.assert_close(model.lm_logits(hidden), lm_head(hidden)[..., [0, 2, 3, 7, 10]])
    assert model.lm_logits(hidden).shape == (2, 3, 5)
    model.set_draft_vocab(torch.tensor([1, 4, 5, 6, 11]))
    torch.testing.assert_close(model.lm_logits(hidden), lm_head(hidden)[..., [1, 4, 5, 6, 11]])
    other = nn.Linear(16, V, bias=False)
    model.share_embeddings(model.embeddings()[0], other)
    torch.testing.assert_close(model.lm_logits(hidden), other(hidden)[..., [1, 4, 5, 6, 11]])
    assert set(model.state_dict()) >= {"d2t", "t2d"} and not any("lm_head" in k for k in model.state_dict())
    with torch.inference_mode():  # a slice made while drafting must not break a later training step
        model.set_draft_vocab(torch.tensor([0, 1, 2, 3, 4]))
        model.lm_logits(hidden)
    model.lm_logits(hidden.requires_grad_()).sum().backward()
    assert hidden.grad is not None
