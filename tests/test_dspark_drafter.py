"""DSpark drafter on tiny random models: train/serve parity, incremental context cache, checkpoints,
proposal semantics, and lossless greedy decoding through the real generation loop."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config

from dspark.drafters.checkpoint import load_dspark, load_model, save_pretrained
from dspark.drafters.dspark import DSparkModel
from dspark.drafters.dspark_config import DSparkConfig, default_target_layer_ids
from dspark.drafters.dspark_drafter import DSparkDrafter
from dspark.errors import DrafterLoadError
from dspark.generation import speculative_decode
from dspark.sampling import SamplingParams, make_generator
from dspark.target import Target

VOCAB, HIDDEN, LAYERS = 96, 64, 4
LAYER_IDS = (-1, 0, 2)  # embeddings + two layers: exercises the feature concatenation
HEAD_TYPES = ["vanilla", "rnn", "gated", None]
#: a reduced draft vocabulary of 40 of the 96 ids, never the mask token (the last id): inputs may lie outside
DRAFT_IDS = torch.randperm(VOCAB - 1, generator=torch.Generator().manual_seed(0))[:40].sort().values


def tiny_target(vocab: int = VOCAB, hidden: int = HIDDEN, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target()


def make_model(target, head_type="vanilla", block_size=5, seed=1, draft_ids=None, **overrides) -> DSparkModel:
    """A random drafter; `draft_ids` (target ids) makes it draft over that reduced vocabulary."""
    torch.manual_seed(seed)
    if draft_ids is not None:
        overrides["draft_vocab_size"] = len(draft_ids)
    config = DSparkConfig.for_target(target.config, num_hidden_layers=2, markov_rank=16,
                                     block_size=block_size, markov_head_type=head_type,
                                     target_layer_ids=LAYER_IDS, **overrides)
    model = DSparkModel(config, target.get_input_embeddings(), target.get_output_embeddings())
    model.init_weights(std=0.2)  # larger than the training init, so the heads matter in the tests
    if draft_ids is not None:
        model.set_draft_vocab(draft_ids)
    return model.eval()


@torch.no_grad()
def features(target, ids: torch.Tensor, layer_ids=LAYER_IDS) -> torch.Tensor:
    """Target features (B, T, m*D) the way dspark.target.Target taps them."""
    hidden_states = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden_states[i + 1] for i in layer_ids], -1)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36) == (1, 9, 17, 25, 33)  # DeepSpec's Qwen3-4B choice
    ids = default_target_layer_ids(30)
    assert len(ids) == 5 and ids[0] == 1 and ids[-1] == 27
    assert default_target_layer_ids(4) == (1,)
    assert DSparkConfig.for_target(tiny_target().config).target_layer_ids == (1,)


@pytest.mark.parametrize("last_context", [False, True], ids=["attention-only", "last-context-input"])
@pytest.mark.parametrize("draft_ids", [None, DRAFT_IDS], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_train_serve_parity(target, head_type, draft_ids, last_context):
    """forward_train on batched anchors == per-request inference path (backbone, heads, confidence);
    with a reduced vocabulary forward_train's logits are over the draft ids and q is their scatter;
    with last_context_input both feed every slot the projected feature of the position before the anchor."""
    temperatures = [0.5, 1.0, 1.5, 2.0, 3.0] if head_type == "rnn" else None
    model = make_model(target, head_type, calibration_temperatures=temperatures, draft_ids=draft_ids,
                       last_context_input=last_context)
    drafter = DSparkDrafter(model)
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 24))
    feats = features(target, ids)
    anchors = torch.tensor([[1, 7, 12, 20], [3, 4, 15, 22]])
    sampling = SamplingParams(temperature=1.0)

    drafts, prev_tokens = {}, torch.zeros(2, 4, 5, dtype=torch.long)
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            state = drafter.start(ids[b, :a], feats[b, :a])
            draft = drafter.propose(state, ids[b, : a + 1], 5, sampling, make_generator(b * 10 + j))
            drafts[b, j] = (state, draft)
            prev_tokens[b, j] = torch.cat([ids[b, a : a + 1], draft.tokens[:-1]])

    with torch.no_grad():
        out = model.forward_train(feats, ids, anchors, prev_tokens=prev_tokens)
        # the block of anchor a must not see features of positions >= a
        later = torch.arange(24)[None, :, None] >= anchors[:, :1, None]
        perturbed = model.forward_train(feats + 5.0 * later, ids, anchors[:, :1],
                                        prev_tokens=prev_tokens[:, :1])
    torch.testing.assert_close(perturbed.logits, out.logits[:, :1])
    assert out.logits.shape[-1] == out.base_logits.shape[-1] == model.draft_vocab_size

    for (b, j), (state, draft) in drafts.items():
        hidden, base_logits = model.draft_blocks([state.cache], ids[b, anchors[b, j]][None])
        torch.testing.assert_close(hidden[0], out.hidden[b, j], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(base_logits[0], out.base_logits[b, j], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(draft.q, model.scatter_to_target(out.logits[b, j].softmax(-1)), atol=1e-6,
                                   rtol=1e-5)
        assert draft.q.shape == (5, VOCAB)
        if draft_ids is not None:
            assert model.t2d[draft.tokens].all()
        if head_type is None:
            torch.testing.assert_close(out.logits, out.base_logits)
        confidence = model.confidence(out.confidence_logits[b, j])
        torch.testing.assert_close(draft.confidence, confidence, atol=1e-6, rtol=1e-5)


    # every block at once, contexts of different lengths padded and masked: the same blocks
    keys = list(drafts)
    hidden, base_logits = model.draft_blocks([drafts[key][0].cache for key in keys],
                                             torch.stack([ids[b, anchors[b, j]] for b, j in keys]))
    assert len({drafts[key][0].cache.length for key in keys}) > 1
    for row, (b, j) in enumerate(keys):
        torch.testing.assert_close(hidden[row], out.hidden[b, j], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(base_logits[row], out.base_logits[b, j], atol=1e-5, rtol=1e-5)

    # default teacher forcing reads the previous tokens from the sequence itself
    b, j, a = 0, 2, int(anchors[0, 2])
    forced = ids.clone()
    forced[b, a + 1 : a + 5] = drafts[b, j][1].tokens[:4]
    with torch.no_grad():
        again = model.forward_train(feats, forced, anchors)
    torch.testing.assert_close(again.logits[b, j], out.logits[b, j])


def test_last_context_input(target, tmp_path):
    """The slots read H_ctx[a-1] directly: changing only the feature before the anchor moves every slot's
    logits even with the context attention cut off; a zero projection is exactly the plain drafter; the
    option and its weight survive a checkpoint round trip."""
    from dspark.train.drafter_specs import warm_start

    model = make_model(target, "vanilla", last_context_input=True)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3))
    feats, anchors = features(target, ids), torch.tensor([[9]])
    before = torch.zeros_like(feats)
    before[:, 8] = 1.0
    with torch.no_grad():
        base = model.forward_train(feats, ids, anchors).logits
        moved = model.forward_train(feats + before, ids, anchors).logits
        assert (moved - base).abs().amax(-1).min() > 1e-3  # every slot
        plain = make_model(target, "vanilla")
        plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("last_context")})
        warm_start(model, target)
        plain.markov_head.markov_w2.weight.zero_()
        torch.testing.assert_close(model.forward_train(feats, ids, anchors).logits,
                                   plain.forward_train(feats, ids, anchors).logits)

    model = make_model(target, "vanilla", last_context_input=True)
    save_pretrained(model, tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["last_context_input"] is True
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.config.last_context_input and torch.equal(loaded.last_context_proj.weight,
                                                            model.last_context_proj.weight)
    save_pretrained(plain, tmp_path / "plain")
    assert "last_context_input" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_confidence_head_inputs(target):
    markov = make_model(target, "vanilla")
    assert markov.confidence_head.proj.in_features == HIDDEN + 16
    dflash = make_model(target, None)
    assert dflash.config.markov_rank == 0 and not dflash.config.confidence_head_with_markov
    assert dflash.confidence_head.proj.in_features == HIDDEN and dflash.markov_head is None
    assert make_model(target, "vanilla", enable_confidence_head=False).confidence_head is None


def test_context_cache_grows_incrementally(target):
    """Commit rounds (crossing the preallocated capacity) == one start on the full context."""
    model = make_model(target, "rnn")
    drafter = DSparkDrafter(model)
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, 75))
    feats = features(target, ids)[0]
    state = drafter.start(ids[0, :58], feats[:58])
    position = 58
    for n in (1, 3, 2, 1, 4, 5):
        drafter.commit(state, feats[position : position + n])
        drafter.flush([state])  # every round drafts: each commit enters the cache before the next
        position += n
    assert state.cache.length == position == 74 and state.num_pending == 0
    fresh = drafter.start(ids[0, :position], feats[:position])
    drafter.flush([fresh])

    incremental = model.draft_blocks([state.cache], ids[0, position][None])
    recomputed = model.draft_blocks([fresh.cache], ids[0, position][None])
    for a, b in zip(incremental, recomputed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    greedy = SamplingParams()
    context = ids[0, : position + 1]
    torch.testing.assert_close(drafter.propose(state, context, 5, greedy, None).tokens,
                               drafter.propose(fresh, context, 5, greedy, None).tokens)
    with pytest.raises(RuntimeError, match="draft cache holds"):
        drafter.propose(state, ids[0, :position], 5, greedy, None)  # a context the cache does not match


def test_commits_wait_until_the_request_drafts_then_enter_the_cache_with_every_drafting_request(target, monkeypatch):
    """A commit projects nothing (a round that does not draft costs the drafter nothing); the next proposal
    projects what every drafting request has waiting in one pass, and the caches and drafts equal those of
    requests whose every commit entered the cache at once; MAX_PENDING bounds what waits."""
    import dspark.drafters.dspark_drafter as module

    model = make_model(target, "rnn")
    drafter = DSparkDrafter(model)
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB, (3, 40))
    feats = features(target, ids)
    lazy = [drafter.start(ids[r, :10 + r], feats[r, :10 + r]) for r in range(3)]
    eager = [drafter.start(ids[r, :10 + r], feats[r, :10 + r]) for r in range(3)]
    drafter.flush(eager)
    passes = []
    monkeypatch.setattr(model, "project_context", lambda f, inner=model.project_context: passes.append(f.shape[1])
                        or inner(f))
    positions = [10, 11, 12]
    for n in (1, 3, 2):  # three rounds of commits, no drafting
        for r in range(3):
            drafter.commit(lazy[r], feats[r, positions[r] : positions[r] + n])
            drafter.commit(eager[r], feats[r, positions[r] : positions[r] + n])
            drafter.flush([eager[r]])
            positions[r] += n
    eager_passes = len(passes)
    assert [s.cache.length for s in lazy] == [0, 0, 0] and [s.num_pending for s in lazy] == positions
    greedy = SamplingParams()
    contexts = [ids[r, : positions[r] + 1] for r in range(3)]
    drafts = drafter.propose_batch(lazy, contexts, [5] * 3, [greedy] * 3, [None] * 3)
    assert len(passes) == eager_passes + 1 and passes[-1] == sum(positions)  # one projection for all three
    assert [s.cache.length for s in lazy] == positions and [s.num_pending for s in lazy] == [0, 0, 0]
    for r in range(3):
        for layer in range(len(model.layers)):
            for got, want in zip(lazy[r].cache.layer(layer), eager[r].cache.layer(layer), strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lazy[r].cache.last_context, eager[r].cache.last_context, atol=1e-5, rtol=1e-5)
        alone = drafter.propose(eager[r], contexts[r], 5, greedy, None)
        assert torch.equal(drafts[r].tokens, alone.tokens)
        torch.testing.assert_close(drafts[r].confidence, alone.confidence, atol=1e-5, rtol=1e-5)

    monkeypatch.setattr(module, "MAX_PENDING", 4)
    drafter.commit(lazy[0], feats[0, positions[0] : positions[0] + 3])
    assert lazy[0].num_pending == 3 and lazy[0].cache.length == positions[0]
    drafter.commit(lazy[0], feats[0, positions[0] + 3 : positions[0] + 4])  # 4 waiting: it catches up alone
    assert lazy[0].num_pending == 0 and lazy[0].cache.length == positions[0] + 4


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_greedy_propose_is_argmax_chain(target, head_type):
    model = make_model(target, head_type)
    drafter = DSparkDrafter(model)
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB, (1, 12))
    feats = features(target, ids)
    state = drafter.start(ids[0, :11], feats[0, :11])
    draft = drafter.propose(state, ids[0], 10, SamplingParams(), None)
    assert len(draft) == 5  # capped at the block size
    prev = torch.cat([ids[0, 11:], draft.tokens[:-1]])[None, None]
    with torch.no_grad():
        logits = model.forward_train(feats, ids, torch.tensor([[11]]), prev_tokens=prev).logits[0, 0]
    assert torch.equal(draft.tokens, logits.argmax(-1))
    assert draft.q is None  # greedy drafts are deterministic: the verifier compares tokens only
    assert draft.confidence.shape == (5,) and ((draft.confidence > 0) & (draft.confidence < 1)).all()
    # a shorter proposal is a prefix: the backbone always runs the whole block, as in training
    short = drafter.propose(state, ids[0], 2, SamplingParams(), None)
    assert torch.equal(short.tokens, draft.tokens[:2])
    assert len(drafter.propose(state, ids[0], 0, SamplingParams(), None)) == 0


def test_sampled_propose(target):
    drafter = DSparkDrafter(make_model(target, "rnn"))
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, 10))
    state = drafter.start(ids[0, :9], features(target, ids)[0, :9])
    sampling = SamplingParams(temperature=0.8, top_k=10)
    draft = drafter.propose(state, ids[0], 5, sampling, make_generator(7))
    torch.testing.assert_close(draft.q.sum(-1), torch.ones(5))
    assert (draft.q[torch.arange(5), draft.tokens] > 0).all()
    assert ((draft.q > 0).sum(-1) <= 10).all()
    again = drafter.propose(state, ids[0], 5, sampling, make_generator(7))
    assert torch.equal(draft.tokens, again.tokens) and torch.equal(draft.q, again.q)


def test_save_load_bit_exact(target, tmp_path):
    model = make_model(target, "rnn", calibration_temperatures=[1.0, 1.2, 1.4, 1.6, 1.8])
    save_pretrained(model, tmp_path / "fp32")
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_head_type"] == "rnn"
    assert config["dspark"]["calibration_temperatures"] == [1.0, 1.2, 1.4, 1.6, 1.8]
    drafter = load_dspark(tmp_path / "fp32", target)
    loaded = drafter.model
    assert loaded.config == model.config and not loaded.owns_embeddings
    assert "embed_tokens.weight" not in loaded.state_dict()
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    ids = torch.randint(0, VOCAB, (1, 8))
    feats = features(target, ids)[0, :7]
    sampling = SamplingParams(temperature=1.0)
    a = DSparkDrafter(model).propose(DSparkDrafter(model).start(ids[0, :7], feats), ids[0], 5, sampling,
                                     make_generator(0))
    b = drafter.propose(drafter.start(ids[0, :7], feats), ids[0], 5, sampling, make_generator(0))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.q, b.q)
    assert torch.equal(a.confidence, b.confidence)

    save_pretrained(model, tmp_path / "fp16", dtype=torch.float16)
    half = load_model(tmp_path / "fp16")
    assert half.dtype == torch.float16
    for key, value in model.state_dict().items():
        assert torch.equal(half.state_dict()[key], value.half()), key
    assert load_dspark(tmp_path / "fp16", target).model.dtype == torch.float32  # follows the target
    assert load_dspark(tmp_path / "fp32", Target(target)).model.config == model.config  # a dspark Target


def deepspec_checkpoint(path, target, model: DSparkModel, embed: torch.Tensor, head: torch.Tensor) -> None:
    """Write `model` the way DeepSpec does: a deep-copied Qwen3 config + DSpark fields, weights with
    the (frozen) embedding and LM head included."""
    c = model.config
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, rms_norm_eps=1e-6).to_dict()
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=LAYERS, block_size=c.block_size,
                  tie_word_embeddings=False, layer_types=["full_attention"] * c.num_hidden_layers,
                  mask_token_id=c.mask_token_id, target_layer_ids=list(c.target_layer_ids), num_anchors=512,
                  enable_confidence_head=True, confidence_head_with_markov=True, markov_rank=c.markov_rank,
                  markov_head_type=c.markov_head_type)
    config.pop("dspark", None)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    weights.update({"embed_tokens.weight": embed.clone(), "lm_head.weight": head.clone()})
    save_file(weights, str(path / "model.safetensors"))


@pytest.mark.parametrize("same_embeddings", [True, False])
def test_deepspec_layout_checkpoint_loads(target, tmp_path, same_embeddings):
    model = make_model(target, "vanilla")
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    if not same_embeddings:
        embed, head = embed + 0.5, head * 2.0
    deepspec_checkpoint(tmp_path / "ckpt", target, model, embed, head)
    drafter = load_dspark(tmp_path / "ckpt", target)
    assert drafter.model.owns_embeddings is not same_embeddings  # identical copies are not kept twice
    assert drafter.target_layer_ids == LAYER_IDS and drafter.max_block_size == 5

    reference = make_model(target, "vanilla")
    if not same_embeddings:
        reference.share_embeddings(torch.nn.Embedding.from_pretrained(embed),
                                   torch.nn.Linear(HIDDEN, VOCAB, bias=False))
        reference.embeddings()[1].weight.data.copy_(head)
    ids = torch.randint(0, VOCAB, (1, 9))
    feats = features(target, ids)[0, :8]
    expected = DSparkDrafter(reference)
    sampling = SamplingParams(1.0)
    want = expected.propose(expected.start(ids[0, :8], feats), ids[0], 5, sampling, make_generator(3))
    got = drafter.propose(drafter.start(ids[0, :8], feats), ids[0], 5, sampling, make_generator(3))
    assert torch.equal(want.tokens, got.tokens)
    torch.testing.assert_close(want.q, got.q)


def test_mismatched_target_refused(target, tmp_path):
    save_pretrained(make_model(target), tmp_path / "ckpt")
    other = tiny_target(vocab=128, hidden=32)
    with pytest.raises(DrafterLoadError) as error:
        load_dspark(tmp_path / "ckpt", other)
    message = str(error.value)
    assert "different target" in message
    assert "vocabulary size 96 vs target 128" in message and "hidden size 64 vs target 32" in message


def test_missing_or_corrupt_files_refused(target, tmp_path):
    with pytest.raises(DrafterLoadError, match="not found"):
        load_dspark(tmp_path / "nowhere", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DrafterLoadError, match="no config.json"):
        load_dspark(tmp_path / "empty", target)

    save_pretrained(make_model(target), tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(DrafterLoadError, match="could not read drafter weights"):
        load_dspark(tmp_path / "ckpt", target)
    weights.unlink()
    with pytest.raises(DrafterLoadError, match="no model.safetensors"):
        load_dspark(tmp_path / "ckpt", target)

    save_pretrained(make_model(target, "vanilla"), tmp_path / "wrong")
    config_file = tmp_path / "wrong" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "markov_head_type": "rnn"}))
    with pytest.raises(DrafterLoadError, match="missing .*joint_proj"):
        load_dspark(tmp_path / "wrong", target)
    config_file.write_text("{not json")
    with pytest.raises(DrafterLoadError, match="not valid JSON"):
        load_dspark(tmp_path / "wrong", target)
    config_file.write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(DrafterLoadError, match="Qwen3DSparkModel"):
        load_dspark(tmp_path / "wrong", target)


@pytest.mark.parametrize("last_context", [False, True], ids=["attention-only", "last-context-input"])
@pytest.mark.parametrize("draft_ids", [None, DRAFT_IDS], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("block_size", [1, 4, 7, 16])
def test_greedy_speculative_decoding_matches_hf_generate(target, block_size, draft_ids, last_context):
    """A random drafter (mostly rejected) must not change greedy output by a single token."""
    drafter = DSparkDrafter(make_model(target, "rnn", block_size=block_size, draft_ids=draft_ids,
                                       last_context_input=last_context))
    torch.manual_seed(6)
    prompt = torch.randint(3, VOCAB, (7,))
    eos = target.generation_config.eos_token_id
    with torch.no_grad():
        expected = target.generate(prompt[None], attention_mask=torch.ones(1, 7, dtype=torch.long),
                                   do_sample=False, max_new_tokens=20)[0, 7:].tolist()
    tokens = []
    chunks = speculative_decode(Target(target, layer_ids=drafter.target_layer_ids), drafter, prompt,
                                max_new_tokens=20, sampling=SamplingParams(), generator=None,
                                block_size=block_size, eos_token_ids=frozenset([eos]))
    for chunk in chunks:
        tokens.extend(chunk)
    assert tokens == expected


# -- reduced draft vocabulary ---------------------------------------------------------------------


def test_oracle_draft_vocab_never_accepts_outside_subset(target, monkeypatch):
    """Base logits replaced by an oracle that puts all mass on the target's true next token whenever
    it is a draft id: the drafts are then right exactly when the greedy token is inside the subset.
    Output == greedy; many drafts are accepted, but a greedy token outside the subset only ever comes
    out as the target's own (recovered or bonus) token, never as an accepted draft."""
    model = make_model(target, None, block_size=4, draft_ids=DRAFT_IDS)
    drafter = DSparkDrafter(model)
    prompt = torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        reference = target.generate(prompt[None], attention_mask=torch.ones(1, 7, dtype=torch.long),
                                    do_sample=False, max_new_tokens=40)[0, 7:].tolist()
    outside = [t for t in reference if not model.t2d[t]]
    assert outside and len(outside) < len(reference)  # both kinds occur, so the test means something
    sequence = torch.tensor(prompt.tolist() + reference + [0] * 8)
    real_draft_blocks = model.draft_blocks

    def oracle(caches, anchors):
        hidden, logits = real_draft_blocks(caches, anchors)
        logits = torch.zeros_like(logits)
        for row, cache in enumerate(caches):
            truth = model.to_draft_ids(sequence[cache.length + 1 : cache.length + 1 + logits.shape[1]])
            inside = truth >= 0
            logits[row, inside.nonzero().flatten(), truth[inside]] = 30.0
        return hidden, logits

    monkeypatch.setattr(model, "draft_blocks", oracle)
    chunks = list(speculative_decode(Target(target, layer_ids=drafter.target_layer_ids), drafter, prompt,
                                     max_new_tokens=40, sampling=SamplingParams(), generator=None, block_size=4))
    assert [t for chunk in chunks for t in chunk] == reference
    accepted = [t for chunk in chunks[1:] for t in chunk[:-1]]
    assert len(accepted) >= len(reference) // 2
    assert all(model.t2d[t] for t in accepted)


def test_draft_vocab_save_load_round_trip(target, tmp_path):
    model = make_model(target, "rnn", draft_ids=DRAFT_IDS)
    save_pretrained(model, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == VOCAB
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as reader:
        assert torch.equal(reader.get_tensor("d2t"), DRAFT_IDS - torch.arange(40))  # EAGLE-3 offsets
        assert reader.get_tensor("t2d").dtype == torch.bool
        assert "lm_head.weight" not in reader.keys()  # the sliced head is the target's: never saved
    drafter = load_dspark(tmp_path / "ckpt", target)
    loaded = drafter.model
    assert loaded.config == model.config and torch.equal(loaded.draft_to_target(), DRAFT_IDS)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(8))
    feats = features(target, ids)
    anchors = torch.tensor([[4, 9]])
    with torch.no_grad():
        want, got = model.forward_train(feats, ids, anchors), loaded.forward_train(feats, ids, anchors)
    assert torch.equal(want.logits, got.logits) and torch.equal(want.confidence_logits, got.confidence_logits)
    sampling = SamplingParams(temperature=1.0)
    a = DSparkDrafter(model).propose(DSparkDrafter(model).start(ids[0, :7], feats[0, :7]), ids[0, :8], 5,
                                     sampling, make_generator(0))
    b = drafter.propose(drafter.start(ids[0, :7], feats[0, :7]), ids[0, :8], 5, sampling, make_generator(0))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.q, b.q)
    half = load_model(tmp_path / "ckpt", dtype=torch.float16)  # integer buffers keep their dtype
    assert half.dtype == torch.float16 and half.d2t.dtype == torch.long and half.t2d.dtype == torch.bool


#: config.json keys of a full-vocabulary checkpoint: DeepSpec, llama.cpp and SGLang read these files.
FULL_VOCAB_CONFIG_KEYS = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "vocab_size",
    "hidden_act", "attention_bias", "tie_word_embeddings", "num_hidden_layers", "num_target_layers",
    "block_size", "target_layer_ids", "mask_token_id", "num_anchors", "markov_rank", "markov_head_type",
    "enable_confidence_head", "confidence_head_with_markov", "dspark", "dtype", "torch_dtype",
}


def test_full_vocab_checkpoint_unchanged(target, tmp_path):
    save_pretrained(make_model(target, "vanilla"), tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert set(config) == FULL_VOCAB_CONFIG_KEYS
    assert set(config["dspark"]) == {"format_version", "drafter_type", "calibration_temperatures"}
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as reader:
        assert not {"d2t", "t2d"} & set(reader.keys())


def _rewrite_weights(path, **changes) -> None:
    file = path / "model.safetensors"
    with safe_open(str(file), framework="pt") as reader:
        weights = {key: reader.get_tensor(key) for key in reader.keys()}
    weights.update(changes)
    save_file({k: v for k, v in weights.items() if v is not None}, str(file))


@pytest.mark.parametrize("d2t, t2d, message", [
    (torch.zeros(39, dtype=torch.long), None, "d2t has 39 entries but draft_vocab_size is 40"),
    (DRAFT_IDS - torch.arange(40) + (torch.arange(40) == 39) * 60, None, "outside the target vocabulary"),
    ((DRAFT_IDS - torch.arange(40)).flip(0), None, "strictly increasing"),
    (None, torch.zeros(VOCAB, dtype=torch.bool), "t2d does not match d2t"),
], ids=["wrong-size", "outside-vocab", "not-increasing", "t2d-mismatch"])
def test_bad_draft_vocab_checkpoint_refused(target, tmp_path, d2t, t2d, message):
    save_pretrained(make_model(target, "vanilla", draft_ids=DRAFT_IDS), tmp_path / "ckpt")
    changes = {key: value for key, value in (("d2t", d2t), ("t2d", t2d)) if value is not None}
    _rewrite_weights(tmp_path / "ckpt", **changes)
    with pytest.raises(DrafterLoadError, match=message):
        load_dspark(tmp_path / "ckpt", target)


def test_draft_vocab_checkpoint_without_map_refused(target, tmp_path):
    save_pretrained(make_model(target, "vanilla", draft_ids=DRAFT_IDS), tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    with safe_open(str(file), framework="pt") as reader:
        weights = {key: reader.get_tensor(key) for key in reader.keys() if key not in ("d2t", "t2d")}
    save_file(weights, str(file))
    with pytest.raises(DrafterLoadError, match="no d2t / t2d"):
        load_dspark(tmp_path / "ckpt", target)


def test_a_drafter_index_naming_a_shard_outside_the_checkpoint_is_refused(tmp_path):
    """A sharded drafter checkpoint's index is data: `../` names must not be read."""
    import json as _json

    from transformers import LlamaConfig

    from dspark.drafters.checkpoint import load_model, save_pretrained
    from dspark.drafters.dspark import DSparkModel
    from dspark.drafters.dspark_config import DSparkConfig
    from dspark.errors import DrafterLoadError

    target = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1)
    drafter = tmp_path / "drafter"
    save_pretrained(DSparkModel(DSparkConfig.for_target(target, num_hidden_layers=1, markov_rank=4)), drafter,
                    dtype=torch.float32)
    (drafter / "model.safetensors").rename(tmp_path / "outside.safetensors")
    (drafter / "model.safetensors.index.json").write_text(
        _json.dumps({"weight_map": {"fc.weight": "../outside.safetensors"}}))
    with pytest.raises(DrafterLoadError, match="model.safetensors.index.json"):
        load_model(drafter)
