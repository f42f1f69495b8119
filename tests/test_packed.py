"""bf16 weights reordered once for oneDNN (`dspark.packed`): the same numbers as F.linear, used by the ragged
forward where the CPU supports them, never stale, and a clean fallback where packing is unavailable."""

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, tiny_model

import dspark.packed as packed_module
from dspark.packed import PackedLinear, pack_linear, packing_supported
from dspark.ragged import RaggedBackend, Segment

needs_packing = pytest.mark.skipif(not packing_supported(torch.bfloat16, torch.device("cpu")),
                                   reason="this CPU's oneDNN has no native bf16 kernels")


@needs_packing
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_is_f_linear_bit_for_bit(with_bias):
    torch.manual_seed(0)
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16) if with_bias else None
    layer = PackedLinear(weight, bias)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, weight, bias))
        assert torch.equal(layer(x)[:1], layer(x[:1]))  # a row's result does not depend on the rows beside it
    assert torch.equal(layer(x.t().contiguous().t()), F.linear(x, weight, bias))  # non-contiguous input


def test_pack_linear_declines_what_it_cannot_pack(monkeypatch):
    assert pack_linear(torch.randn(8, 4)) is None  # float32: F.linear stays
    assert pack_linear(torch.randn(8, 4, dtype=torch.bfloat16)[None]) is None  # not a matrix

    def refuse(*args, **kwargs):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(packed_module, "PackedLinear", refuse)
    assert pack_linear(torch.randn(8, 4, dtype=torch.bfloat16)) is None
    monkeypatch.setattr(packed_module, "packing_supported", lambda dtype, device: False)
    assert pack_linear(torch.randn(8, 4, dtype=torch.bfloat16)) is None


def forward_logits(backend: RaggedBackend, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Prefill then two verify-sized steps: the logits of every position."""
    slot = backend.allocate()
    outputs = [backend.forward([Segment(slot, tokens[:6])])[0].logits]
    outputs.append(backend.forward([Segment(slot, tokens[6:14])])[0].logits)
    outputs.append(backend.forward([Segment(slot, tokens[14:15])])[0].logits)
    backend.release(slot)
    return outputs


@needs_packing
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases ride in the packed layer
def test_ragged_forward_packs_by_default_and_computes_the_same(arch):
    model = tiny_model(arch).to(torch.bfloat16)
    tokens = torch.randint(3, VOCAB, (15,), generator=torch.Generator().manual_seed(1))
    packed = RaggedBackend(model, max_slots=1)
    plain = RaggedBackend(model, max_slots=1, packed_weights=False)
    assert packed.packed_weights and not plain.packed_weights
    assert isinstance(packed.lm_head, PackedLinear) and isinstance(packed.layers[0].down, PackedLinear)
    for a, b in zip(forward_logits(packed, tokens), forward_logits(plain, tokens), strict=True):
        assert torch.equal(a, b)
    assert RaggedBackend(model, max_slots=1).layers[0].qkv is packed.layers[0].qkv  # one copy per model


def test_float32_models_are_not_packed():
    backend = RaggedBackend(tiny_model("llama"), max_slots=1)
    assert not backend.packed_weights and isinstance(backend.layers[0].qkv, torch.Tensor)


@needs_packing
def test_a_weight_written_in_place_is_packed_again():
    model = tiny_model("llama").to(torch.bfloat16)
    tokens = torch.randint(3, VOCAB, (15,), generator=torch.Generator().manual_seed(2))
    before = forward_logits(RaggedBackend(model, max_slots=1), tokens)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2)  # a view of the fused weight: its version moves
    after = forward_logits(RaggedBackend(model, max_slots=1), tokens)
    reference = forward_logits(RaggedBackend(model, max_slots=1, packed_weights=False), tokens)
    assert not torch.equal(before[-1], after[-1])
    assert all(torch.equal(a, b) for a, b in zip(after, reference, strict=True))
