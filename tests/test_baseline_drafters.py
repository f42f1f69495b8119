"""EAGLE-3 and MTP baseline drafters: lossless greedy output, train/serve parity, incremental caches,
checkpoints."""

import json

import pytest
import torch
from conftest import VOCAB, hf_greedy, tiny_model
from safetensors.torch import load_file

from dspark.drafters.eagle3 import Eagle3Drafter, Eagle3Model
from dspark.drafters.mtp import MTPDrafter, MTPModel
from dspark.errors import DrafterLoadError
from dspark.generation import GenerationStats, speculative_decode
from dspark.sampling import SamplingParams, make_generator
from dspark.target import Target

GAMMA = 4


@pytest.fixture(scope="module")
def target_model():
    return tiny_model("llama", num_layers=4)


DRAFT_VOCAB = 64  # the "-vocab" kinds: an EAGLE-3-style reduced draft vocabulary of 64 of the 96 ids


def base_kind(kind: str) -> str:
    return kind.removesuffix("-vocab")


def make_drafter(kind: str, target_model, seed: int = 0):
    torch.manual_seed(seed)
    draft_vocab_size = DRAFT_VOCAB if kind.endswith("-vocab") else None
    if base_kind(kind) == "eagle3":
        drafter = Eagle3Drafter(Eagle3Model.for_target(target_model, num_speculative_tokens=GAMMA,
                                                       draft_vocab_size=draft_vocab_size))
    else:
        drafter = MTPDrafter(MTPModel.for_target(target_model, num_modules=2, num_speculative_tokens=GAMMA,
                                                 draft_vocab_size=draft_vocab_size))
    if draft_vocab_size:  # a scattered subset, so draft ids and target ids differ
        subset = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB]
        drafter.model.set_draft_vocab(subset)
    return drafter


class Recording:
    """Wraps a drafter and keeps the state of the last request, to inspect it after decoding."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.state = None

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def start(self, prompt_ids, prompt_hidden):
        self.state = self.drafter.start(prompt_ids, prompt_hidden)
        return self.state


def decode(target_model, drafter, prompt, max_new_tokens, block_size=GAMMA) -> list[int]:
    target = Target(target_model, layer_ids=drafter.target_layer_ids)
    chunks = speculative_decode(target, drafter, prompt, max_new_tokens=max_new_tokens, sampling=SamplingParams(),
                                generator=None, block_size=block_size)
    return [token for chunk in chunks for token in chunk]


def prompt_ids(length: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def features(target_model, drafter, ids: torch.Tensor) -> torch.Tensor:
    """Target features of every position of `ids`, from one fresh forward."""
    return Target(target_model, layer_ids=drafter.target_layer_ids).prefill(ids).hidden


def decoded_state(kind, target_model):
    """A drafter state after several real rounds, and the committed context it belongs to."""
    drafter = Recording(make_drafter(kind, target_model))
    prompt = prompt_ids()
    context = torch.cat([prompt, torch.tensor(decode(target_model, drafter, prompt, 13, block_size=3))])
    return drafter.drafter, drafter.state, context


KINDS = ["eagle3", "mtp", "eagle3-vocab", "mtp-vocab"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [1, GAMMA])
def test_greedy_equals_generate(target_model, kind, block_size):
    prompt = prompt_ids()
    drafter = make_drafter(kind, target_model)
    assert decode(target_model, drafter, prompt, 20, block_size) == hf_greedy(target_model, prompt, 20)


@pytest.mark.parametrize("kind", KINDS)
def test_training_forward_matches_inference(target_model, kind):
    """After several incremental rounds, every draft step's q equals the training forward's softmax."""
    drafter, state, context = decoded_state(kind, target_model)
    sampling = SamplingParams(temperature=1.0)
    draft = drafter.propose(state, context, GAMMA, sampling, make_generator(0))
    ids = torch.cat([context, draft.tokens])
    feats = features(target_model, drafter, context[:-1])
    feats = torch.cat([feats, feats.new_zeros(ids.shape[0] - feats.shape[0], feats.shape[1])])  # unused positions
    with torch.no_grad():
        logits = drafter.model(feats[None], ids[None], GAMMA)
    anchor_feature = context.shape[0] - 2
    expected = torch.stack([drafter.model.scatter_to_target(step[0, anchor_feature].float().softmax(-1))
                            for step in logits])
    torch.testing.assert_close(draft.q, expected, atol=1e-5, rtol=1e-4)


def caches(state):
    return [state.cache] if hasattr(state, "cache") else state.caches


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_cache_equals_recompute(target_model, kind):
    drafter, state, context = decoded_state(kind, target_model)
    fresh = drafter.start(context[:-1], features(target_model, drafter, context[:-1]))
    greedy = SamplingParams()
    incremental_draft = drafter.propose(state, context, GAMMA, greedy, None)
    fresh_draft = drafter.propose(fresh, context, GAMMA, greedy, None)
    assert torch.equal(incremental_draft.tokens, fresh_draft.tokens)
    for grown, recomputed in zip(caches(state), caches(fresh), strict=True):
        assert grown.length == recomputed.length > 0
        for a, b in zip(grown.keys_values(), recomputed.keys_values(), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    if base_kind(kind) == "mtp":
        for grown, recomputed in zip(state.inputs, fresh.inputs, strict=True):
            torch.testing.assert_close(grown, recomputed, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_q_rows_are_distributions(target_model, kind):
    drafter = make_drafter(kind, target_model)
    prompt = prompt_ids()
    sampling = SamplingParams(temperature=0.8, top_p=0.9)

    def draft(seed):
        state = drafter.start(prompt[:-1], features(target_model, drafter, prompt[:-1]))
        return drafter.propose(state, prompt, GAMMA, sampling, make_generator(seed))

    first = draft(3)
    assert first.tokens.shape == (GAMMA,) and first.q.shape == (GAMMA, VOCAB)
    assert (first.q >= 0).all()
    torch.testing.assert_close(first.q.sum(-1), torch.ones(GAMMA))
    assert (first.q[torch.arange(GAMMA), first.tokens] > 0).all()
    assert (first.q.max(-1).values < 1).any(), "T > 0 must not draft greedily"
    assert torch.equal(draft(3).tokens, first.tokens)
    if drafter.model.reduced_vocab:  # q is zero outside the draft vocabulary, the tokens are target ids inside it
        assert (first.q[:, ~drafter.model.t2d] == 0).all()
        assert drafter.model.t2d[first.tokens].all()

    state = drafter.start(prompt[:-1], features(target_model, drafter, prompt[:-1]))
    greedy = drafter.propose(state, prompt, GAMMA, SamplingParams(), None)
    assert torch.equal(greedy.q, torch.nn.functional.one_hot(greedy.tokens, VOCAB).float())


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_bit_exact(target_model, kind, tmp_path):
    drafter = make_drafter(kind, target_model, seed=5)
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dspark"]["drafter_type"] == base_kind(kind)
    assert config["architectures"] == [{"eagle3": "Eagle3LlamaForCausalLM", "mtp": "DSparkMTPModel"}[base_kind(kind)]]
    stored = load_file(tmp_path / "model.safetensors")
    assert not any("embed" in name or "lm_head" in name for name in stored)
    assert config.get("draft_vocab_size") == drafter.config.draft_vocab_size  # absent for the full vocabulary
    assert ("d2t" in stored) == ("t2d" in stored) == drafter.model.reduced_vocab

    for target in (target_model, Target(target_model)):
        loaded = type(drafter).from_pretrained(tmp_path, target)
        assert loaded.config == drafter.config
        original, restored = drafter.model.state_dict(), loaded.model.state_dict()
        assert original.keys() == restored.keys()
        assert all(torch.equal(original[name], restored[name]) for name in original)

    prompt = prompt_ids()
    assert decode(target_model, loaded, prompt, 10) == decode(target_model, drafter, prompt, 10)


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_checkpoint_loads_and_its_index_stays_inside(target_model, kind, tmp_path):
    """Baselines read weights through the same reader as DSpark: shards load, names leaving the directory don't."""
    drafter = make_drafter(kind, target_model, seed=5)
    drafter.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00001.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {name: "model-00001-of-00001.safetensors" for name in weights}}))
    restored = type(drafter).from_pretrained(tmp_path, target_model).model.state_dict()
    assert all(torch.equal(weights[name], restored[name]) for name in weights)

    index.write_text(json.dumps({"weight_map": {name: "../model-00001-of-00001.safetensors" for name in weights}}))
    with pytest.raises(DrafterLoadError, match="outside the checkpoint directory"):
        type(drafter).from_pretrained(tmp_path, target_model)


@pytest.mark.parametrize("kind", KINDS)
def test_load_refuses_mismatch_and_damage(target_model, kind, tmp_path):
    drafter = make_drafter(kind, target_model)
    drafter.save_pretrained(tmp_path)
    loader = type(drafter).from_pretrained

    torch.manual_seed(0)
    narrow = type(target_model)(type(target_model.config)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2))
    wide_vocab = type(target_model)(type(target_model.config)(
        vocab_size=VOCAB + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2))
    shallow = tiny_model("llama", num_layers=2)  # MTP reads layer 3; EAGLE-3's default ids fit
    for other in (narrow, wide_vocab) + ((shallow,) if base_kind(kind) == "mtp" else ()):
        with pytest.raises(DrafterLoadError):
            loader(tmp_path, other)

    other_kind = tmp_path / "other"
    make_drafter("mtp" if base_kind(kind) == "eagle3" else "eagle3", target_model).save_pretrained(other_kind)
    with pytest.raises(DrafterLoadError, match="not"):
        loader(other_kind, target_model)

    weights = tmp_path / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(DrafterLoadError, match="could not read drafter weights"):  # the reader DSpark uses too
        loader(tmp_path, target_model)
    weights.unlink()
    with pytest.raises(DrafterLoadError, match="no model.safetensors"):
        loader(tmp_path, target_model)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DrafterLoadError, match="JSON"):
        loader(tmp_path, target_model)
    (tmp_path / "config.json").unlink()
    with pytest.raises(DrafterLoadError, match="no config.json"):
        loader(tmp_path, target_model)


@pytest.mark.parametrize("kind", KINDS)
def test_trained_drafter_is_accepted(target_model, kind):
    """End-to-end alignment: a drafter that memorised the target's continuations through the training
    forward must see its drafts accepted by the real loop, whose output stays the target's."""
    prompts = torch.randint(3, VOCAB, (4, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        sequences = target_model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=24,
                                          do_sample=False)
    drafter = make_drafter(kind, target_model)
    model = drafter.model
    if model.reduced_vocab:  # the continuations' tokens, then the most frequent others: as the trainer chooses
        counts = torch.bincount(sequences[:, 4:].flatten(), minlength=VOCAB)
        model.set_draft_vocab(torch.sort(-counts.double(), stable=True).indices[:DRAFT_VOCAB])
    labels = model.to_draft_ids(sequences)
    ids = drafter.target_layer_ids
    with torch.no_grad():
        hidden_states = target_model(sequences, output_hidden_states=True).hidden_states
    feats = torch.cat([hidden_states[i + 1] for i in ids], -1)  # DeepSpec id i = HF hidden_states[i + 1]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = sum(
            torch.nn.functional.cross_entropy(step[:, : -j - 2].reshape(-1, model.draft_vocab_size),
                                              labels[:, j + 2 :].reshape(-1), ignore_index=-1)
            for j, step in enumerate(model(feats, sequences, GAMMA))
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.model.eval()

    stats = GenerationStats()
    target = Target(target_model, layer_ids=ids)
    chunks = speculative_decode(target, drafter, prompts[0], max_new_tokens=20, sampling=SamplingParams(),
                                generator=None, block_size=GAMMA, stats=stats)
    assert [token for chunk in chunks for token in chunk] == sequences[0, 4:24].tolist()
    assert stats.tau >= 3.0, stats.to_dict()


@pytest.mark.parametrize("kind", ["eagle3-vocab", "mtp-vocab"])
def test_load_refuses_a_bad_draft_vocabulary(target_model, kind, tmp_path):
    """A d2t / t2d that does not name `draft_vocab_size` distinct ids would draft other tokens than the ones
    learnt: refused with a clear error, as for DSpark checkpoints."""
    from safetensors.torch import save_file

    make_drafter(kind, target_model).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    good = load_file(path)
    duplicate = good["d2t"].clone()
    duplicate[1] = duplicate[0] - 1  # draft ids 0 and 1 -> the same target id
    for change, message in [({"d2t": good["d2t"][:-1]}, "entries"), ({"d2t": duplicate}, "d2t is invalid"),
                            ({"t2d": ~good["t2d"]}, "does not match"), ({"d2t": None}, "no d2t")]:
        weights = {**good, **change}
        save_file({name: tensor for name, tensor in weights.items() if tensor is not None}, str(path))
        with pytest.raises(DrafterLoadError, match=message):
            type(make_drafter(kind, target_model)).from_pretrained(tmp_path, target_model)
