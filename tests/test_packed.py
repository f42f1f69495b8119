"""Weights reordered once for oneDNN (`dspark.packed`): bf16 gives the same numbers as F.linear and is used by
the ragged forward where the CPU supports it; float32 is close and row-independent, packed by default where bf16
is not native; never stale, and a clean fallback where packing is unavailable."""

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, tiny_model

import dspark.packed as packed_module
from dspark.packed import PackedLinear, pack_linear, pack_linears, packing_supported
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
    assert pack_linear(torch.randn(8, 4, dtype=torch.float16)) is None  # float16: F.linear stays
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


def test_float32_models_are_packed_where_bf16_is_not_native():
    """Packed float32 is oneDNN's kernel, not F.linear's: close and rows independent, not bit-identical. It is the
    default only where `auto` runs float32 (no native bf16), where it was measured; elsewhere an opt-in."""
    model = tiny_model("llama")
    if not packing_supported(torch.float32, torch.device("cpu")):
        pytest.skip("no oneDNN in this torch")
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    cpu, big = torch.device("cpu"), packed_module.MIN_FLOAT32_ELEMENTS
    assert packed_module.packed_by_default(torch.float32, cpu) is not native_bf16
    assert packed_module.packed_by_default(torch.float32, cpu, big) is not native_bf16
    assert not packed_module.packed_by_default(torch.float32, cpu, big - 1)  # too small: oneDNN's overhead loses
    assert not RaggedBackend(model, max_slots=1).packed_weights  # the tiny model's 32-wide layers
    assert pack_linears(torch.nn.Sequential(torch.nn.Linear(4, 4))) == 0
    drafter_sized = torch.nn.Sequential(torch.nn.Linear(512, 512))
    assert (pack_linears(drafter_sized) == 1) is not native_bf16  # drafters follow the same default
    plain = RaggedBackend(model, max_slots=1, packed_weights=False)
    packed = RaggedBackend(model, max_slots=1, packed_weights=True)
    assert packed.packed_weights and isinstance(packed.lm_head, PackedLinear)
    assert not plain.packed_weights and isinstance(plain.layers[0].qkv, torch.Tensor)
    tokens = torch.randint(3, VOCAB, (15,), generator=torch.Generator().manual_seed(1))
    for a, b in zip(forward_logits(packed, tokens), forward_logits(plain, tokens), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_float16_is_never_packed():
    assert not packed_module.packed_by_default(torch.float16, torch.device("cpu"))
    assert not RaggedBackend(tiny_model("llama").to(torch.float16), max_slots=1).packed_weights


def test_a_packed_float32_row_does_not_depend_on_the_rows_beside_it():
    """What keeps speculative decoding identical to our own vanilla decoding with packed float32 weights: a
    verify forward of 8 rows computes each row as the decode step of that row alone would."""
    if not packing_supported(torch.float32, torch.device("cpu")):
        pytest.skip("no oneDNN in this torch")
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    layer = PackedLinear(weight, bias)
    x = torch.randn(8, 64)
    with torch.inference_mode():
        rows = layer(x)
        assert all(torch.equal(rows[r:r + 1], layer(x[r:r + 1])) for r in range(8))
        torch.testing.assert_close(rows, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_packing
def test_a_weight_written_in_place_is_packed_again():
    model = tiny_model("llama").to(torch.bfloat16)
    tokens = torch.randint(3, VOCAB, (15,), generator=torch.Generator().manual_seed(2))
    alive = RaggedBackend(model, max_slots=1)
    before = forward_logits(alive, tokens)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2)  # a view of the fused weight: its version moves
    after = forward_logits(RaggedBackend(model, max_slots=1), tokens)
    reference = forward_logits(RaggedBackend(model, max_slots=1, packed_weights=False), tokens)
    assert not torch.equal(before[-1], after[-1])
    assert all(torch.equal(a, b) for a, b in zip(after, reference, strict=True))
    # the backend made before the write serves the written weights too, and so does a qkv write
    assert all(torch.equal(a, b) for a, b in zip(forward_logits(alive, tokens), reference, strict=True))
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.add_(0.5)
    reference = forward_logits(RaggedBackend(model, max_slots=1, packed_weights=False), tokens)
    assert all(torch.equal(a, b) for a, b in zip(forward_logits(alive, tokens), reference, strict=True))


@needs_packing
def test_a_packed_linear_trains_through_the_dense_weight_and_never_serves_a_stale_copy():
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 32).to(torch.bfloat16)
    weight, bias = (torch.nn.Parameter(p.detach().clone()) for p in (dense.weight, dense.bias))
    layer = PackedLinear(weight, bias)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    layer(x).float().sum().backward()
    dense(x).float().sum().backward()
    assert torch.equal(layer.weight.grad, dense.weight.grad) and torch.equal(layer.bias.grad, dense.bias.grad)
    with torch.no_grad():
        layer.weight.sub_(layer.weight.grad)  # an optimiser step: the packed copy is now out of date
        with torch.inference_mode():
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_packing
def test_pack_linears_keeps_the_state_dict_and_the_numbers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False))
    model = model.to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
    assert pack_linears(model) == 2 and all(isinstance(model[i], PackedLinear) for i in (0, 2))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)
    assert pack_linears(torch.nn.Sequential(torch.nn.Linear(512, 512, dtype=torch.float16))) == 0  # float16 stays


@needs_packing
def test_a_bf16_drafter_drafts_the_same_packed_or_not(tiny_on_disk, monkeypatch):
    """The DSpark drafter is packed when loaded for drafting in bf16 (layers, Markov and confidence heads and
    the reduced LM head slice), and proposes the same tokens, q and confidences as unpacked."""
    import dspark.drafters as drafters
    from dspark.loading import load_target
    from dspark.sampling import SamplingParams, make_generator

    target = load_target(str(tiny_on_disk / "target"), dtype=torch.bfloat16)
    prompt = torch.randint(3, 40, (12,), generator=torch.Generator().manual_seed(3))

    def draft(drafter):
        from dspark.target import Target

        hidden = Target(target.model, layer_ids=drafter.target_layer_ids).prefill(prompt[:-1]).hidden
        state = drafter.start(prompt[:-1], hidden)
        return drafter.propose(state, prompt, 4, SamplingParams(temperature=1.0), make_generator(0))

    packed = drafters.load_drafter(str(tiny_on_disk / "drafter"), target.model, draft_dtype=torch.bfloat16)
    assert isinstance(packed.model.layers[0].mlp.down_proj, PackedLinear)
    monkeypatch.setattr(drafters, "pack_linears", lambda module: 0)
    plain = drafters.load_drafter(str(tiny_on_disk / "drafter"), target.model, draft_dtype=torch.bfloat16)
    assert isinstance(plain.model.layers[0].mlp.down_proj, torch.nn.Linear)
    a, b = draft(packed), draft(plain)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.q, b.q)
    assert torch.equal(a.confidence, b.confidence)


@needs_packing
def test_the_reduced_lm_head_slice_is_packed_for_drafting_only():
    """U_k over a reduced vocabulary: the packed slice when drafting, F.linear (with gradients) when training."""
    from test_draft_vocab import tiny_model as tiny_drafter

    model = tiny_drafter(5).to(torch.bfloat16)
    model.share_embeddings(*(m.to(torch.bfloat16) for m in model.embeddings()))
    model.set_draft_vocab(torch.tensor([0, 2, 3, 7, 10]))
    hidden = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    expected = F.linear(hidden, model.embeddings()[1].weight[[0, 2, 3, 7, 10]])
    with torch.inference_mode():
        assert torch.equal(model.lm_logits(hidden), expected)
    assert isinstance(model._sliced_head[4], PackedLinear)
    trained = hidden.clone().requires_grad_()
    model.lm_logits(trained).float().sum().backward()
    assert trained.grad is not None and torch.equal(model.lm_logits(hidden.clone()), expected)


def test_automatic_packing_stays_within_a_share_of_memory(monkeypatch):
    import dspark.ragged as ragged

    assert packed_module.affordable(1 << 20) and not packed_module.affordable(1 << 60)
    monkeypatch.setattr(ragged, "affordable", lambda num_bytes: False)  # a model too big to copy here
    model = tiny_model("llama").to(torch.bfloat16)
    assert not RaggedBackend(model, max_slots=1).packed_weights and not ragged.auto_packed(model)  # profile: plain
    if packing_supported(torch.bfloat16, torch.device("cpu")):
        assert RaggedBackend(model, max_slots=1, packed_weights=True).packed_weights  # asked for: packed anyway
