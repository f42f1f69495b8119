"""Int4 weight-only targets (`--dtype int4`): the layer computes what its codes stand for, fusing keeps it
exact, and every forward of an int4 target (HF's, ours, speculative) agrees with the others."""

import pytest
import torch
from conftest import hf_greedy, tiny_model
from torch import nn

from dspark.drafters.ngram import NgramDrafter
from dspark.engine import Engine, Request, make_backend
from dspark.errors import DsparkError
from dspark.loading import load_target, resolve_dtype, target_dtype_name
from dspark.quantize import Int4Linear, can_quantize, dequantize, is_int4, quantize_int4_, quantize_weight
from dspark.ragged import RaggedBackend, Segment
from dspark.sampling import SamplingParams


def test_codes_reproduce_a_weight_that_is_already_4_bit():
    """A weight made of 16 levels per group (what a Q4 GGUF de-quantises to) re-quantises exactly."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 64), generator=generator)
    codes[:, ::32], codes[:, 1::32] = 0, 15  # every group spans the full range, as a quantiser leaves it
    scale = torch.rand(32, 2, generator=generator) + 0.1
    low = torch.randn(32, 2, generator=generator)
    weight = (codes.view(32, 2, 32) * scale[..., None] + low[..., None]).view(32, 64)
    found, scales_zeros = quantize_weight(weight)
    assert torch.equal(found, codes)
    torch.testing.assert_close(dequantize(found, scales_zeros), weight, atol=1e-5, rtol=1e-5)


def test_int4_linear_computes_its_dequantized_weight_and_fuses_exactly():
    torch.manual_seed(0)
    parts = [nn.Linear(64, n, bias=True).to(torch.bfloat16) for n in (32, 16, 16)]
    layers = [Int4Linear.from_linear(p) for p in parts]
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    for part, layer in zip(parts, layers, strict=True):
        reference = x.float() @ dequantize(layer.codes.int(), layer.scales_zeros).T + part.bias.float()
        torch.testing.assert_close(layer(x).float(), reference, atol=3e-2, rtol=2e-2)
        assert (layer(x).float() - x.float() @ part.weight.float().T - part.bias.float()).abs().max() > 1e-3
    fused = Int4Linear.concat(layers)
    assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], -1))
    assert fused(x[None]).shape == (1, 5, 64)


def test_layers_the_kernel_cannot_take_stay_dense():
    assert can_quantize(nn.Linear(64, 32))
    assert not can_quantize(nn.Linear(64, 30)) and not can_quantize(nn.Linear(48, 32))  # N % 16, K % 32
    model = tiny_model("llama", num_layers=2).to(torch.bfloat16)
    replaced = quantize_int4_(model)
    assert is_int4(model) and replaced == 2 * 7 + (model.config.vocab_size % 16 == 0)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int4Linear)


@pytest.fixture(scope="module")
def int4_model():
    model = tiny_model("llama", num_layers=3).to(torch.bfloat16)
    quantize_int4_(model)
    return model


def test_ragged_forward_of_an_int4_target_matches_hf(int4_model):
    ids = torch.randint(3, int4_model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    backend = RaggedBackend(int4_model, layer_ids=(0, 2), max_slots=1)
    with torch.inference_mode():
        hf = int4_model(input_ids=ids[None], output_hidden_states=True)
    ours = backend.forward([Segment(backend.allocate(), ids)])[0]
    torch.testing.assert_close(ours.logits, hf.logits[0].float(), atol=5e-2, rtol=5e-2)
    assert torch.equal(ours.logits.argmax(-1), hf.logits[0].float().argmax(-1))


def test_speculative_greedy_equals_vanilla_in_int4(int4_model):
    """Exactness per dtype: speculation in int4 decodes what int4 vanilla decoding does."""
    prompt = torch.tensor([5, 9, 5, 9, 5, 9, 7])
    outputs = {}
    for name, drafter, block in (("vanilla", NgramDrafter(max_ngram=2), 0), ("ngram", NgramDrafter(max_ngram=2), 4)):
        engine = Engine(make_backend(int4_model), drafter, block_size=block)
        request = Request(prompt, 24, SamplingParams())
        engine.run([request])
        outputs[name] = request.output_ids
    assert outputs["ngram"] == outputs["vanilla"] == hf_greedy(int4_model, prompt, 24)


def test_int4_is_a_dtype_name_on_cpu_only(tiny_on_disk):
    assert resolve_dtype("int4") in (torch.bfloat16, torch.float32)  # activations: what auto picks
    loaded = load_target(str(tiny_on_disk / "target"), "int4")
    assert is_int4(loaded.model) and target_dtype_name(loaded.model) == "int4"
    assert target_dtype_name(load_target(str(tiny_on_disk / "target"), "float32").model) == "float32"
    with pytest.raises(DsparkError, match="CPU only"):
        load_target(str(tiny_on_disk / "target"), "int4", device="cuda")


def test_backends_on_one_int4_model_share_its_fused_layers(int4_model):
    first, second = RaggedBackend(int4_model), RaggedBackend(int4_model)
    assert isinstance(first.layers[0].qkv, Int4Linear) and first.layers[0].qkv is second.layers[0].qkv
    assert first.layers[1].gate_up is second.layers[1].gate_up and first.layers[0].qkv is not first.layers[1].qkv
