"""Offline feature cache and the cached training pipeline: the cache equals a fresh target forward,
stale / corrupt / truncated / incomplete caches are refused, the top-k loss is the full loss when
k = V, and cached training resumes exactly."""

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file

from dspark.errors import DsparkError
from dspark.train.cached_data import CachedExample, answer_mask, cached_examples, make_cached_batch, token_counts
from dspark.train.checkpointing import STATE_FILE, checkpoints
from dspark.train.corpus import Corpus, save_corpus
from dspark.train.feature_cache import (
    CacheKey,
    FeatureCache,
    FeatureCacheError,
    build_cache,
    model_fingerprint,
    plan_shards,
    sample_bounds,
)
from dspark.train.losses import (
    LossWeights,
    TopKTeacher,
    block_loss,
    chunked_block_loss,
    greedy_accepts,
    topk_block_loss,
)
from dspark.train.trainer import train

LAYERS = (0, 2, 3)


def make_corpus(count: int = 12, seed: int = 0, vocab: int = 96) -> Corpus:
    """Synthetic samples whose answers follow an arithmetic pattern (learnable)."""
    generator = np.random.default_rng(seed)
    tokens, offsets, prompts = [], [0], []
    for _ in range(count):
        prompt = generator.integers(3, 90, int(generator.integers(3, 9))).tolist()
        start = int(generator.integers(3, 90))
        answer = [(start + 3 * k) % 87 + 3 for k in range(int(generator.integers(6, 20)))] + [2]
        tokens += prompt + answer
        offsets.append(len(tokens))
        prompts.append(len(prompt))
    return Corpus(np.array(tokens, dtype=np.uint16), np.array(offsets, dtype=np.int64),
                  np.array(prompts, dtype=np.int32), np.ones(count, dtype=np.uint8), np.zeros(count, dtype=np.uint8),
                  [f"s{i}" for i in range(count)], ["test"], {"target": "tiny", "vocab_size": vocab})


def key_for(model, corpus, **changes) -> CacheKey:
    values = dict(target="tiny", target_fingerprint=model_fingerprint(model), layers=LAYERS, dtype="float32",
                  top_k=8, max_len=24, corpus_checksum=corpus.checksum)
    values.update(changes)
    return CacheKey(**values)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    model = tiny_model("llama", num_layers=4)
    corpus = make_corpus()
    key = key_for(model, corpus)
    build_cache(root / "cache", model, corpus.tokens, corpus.offsets, key, shard_tokens=60, batch_tokens=64,
                progress=False)
    return root, model, corpus, key


def test_shard_plan_covers_every_sample_once():
    bounds = sample_bounds(np.array([0, 10, 50, 55, 200]), max_len=30)
    assert bounds.tolist() == [0, 10, 40, 45, 75]
    shards = plan_shards(bounds, 35)
    assert shards[0][0] == 0 and shards[-1][1] == 4
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:], strict=False))


def test_cache_equals_a_fresh_target_forward(built):
    root, model, corpus, key = built
    cache = FeatureCache.open(root / "cache", key)
    assert cache.num_samples == corpus.num_samples and len(cache.manifest["shards"]) > 1
    for index in (0, 5, corpus.num_samples - 1):
        start = int(corpus.offsets[index])
        length = cache.length(index)
        assert length == min(int(corpus.offsets[index + 1]) - start, key.max_len)
        ids = torch.from_numpy(corpus.tokens[start : start + length].astype(np.int64))[None]
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        expected = torch.cat([out.hidden_states[i + 1] for i in LAYERS], -1)[0]
        sample = cache.sample(index)
        torch.testing.assert_close(sample.hidden.float(), expected, rtol=1e-2, atol=1e-2)  # bf16 storage
        logits = out.logits[0].float()
        top = logits.topk(key.top_k, -1)
        assert torch.equal(sample.topk_ids, top.indices)
        torch.testing.assert_close(sample.topk_logits, top.values, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sample.logsumexp, logits.logsumexp(-1), rtol=1e-4, atol=1e-4)
        subset = cache.sample(index, layers=(3, 0))
        torch.testing.assert_close(subset.hidden.float(), torch.cat([expected[:, 64 * 2 :], expected[:, :64]], -1),
                                   rtol=1e-2, atol=1e-2)
    with pytest.raises(FeatureCacheError, match="not \\[1\\]"):
        cache.columns((1,))


def test_resumed_build_equals_one_pass(built, tmp_path):
    root, model, corpus, key = built
    first = build_cache(tmp_path / "cache", model, corpus.tokens, corpus.offsets, key, shard_tokens=60,
                        batch_tokens=64, max_shards=1, progress=False)
    assert first.shards_written == 1
    with pytest.raises(FeatureCacheError, match="incomplete"):
        FeatureCache.open(tmp_path / "cache")
    (tmp_path / "cache" / "shard_00001.tmp").mkdir()  # a shard cut by a kill
    rest = build_cache(tmp_path / "cache", model, corpus.tokens, corpus.offsets, key, shard_tokens=60,
                       batch_tokens=64, progress=False)
    assert rest.shards_before == 1 and not list((tmp_path / "cache").glob("*.tmp"))
    one_pass = json.loads((root / "cache" / "manifest.json").read_text())
    resumed = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert resumed["shards"] == one_pass["shards"]  # same files, same digests


def test_stale_cache_is_refused(built, tmp_path):
    root, model, corpus, key = built
    other = make_corpus(seed=1)
    with pytest.raises(FeatureCacheError, match="corpus_checksum"):
        build_cache(root / "cache", model, other.tokens, other.offsets, key_for(model, other), progress=False)
    with pytest.raises(FeatureCacheError, match="stale.*corpus_checksum"):
        FeatureCache.open(root / "cache", key_for(model, other))
    another_model = tiny_model("llama", seed=1, num_layers=4)
    with pytest.raises(FeatureCacheError, match="target_fingerprint"):
        FeatureCache.open(root / "cache", key_for(another_model, corpus))
    assert model_fingerprint(model) == model_fingerprint(tiny_model("llama", num_layers=4).to(torch.bfloat16))


def test_a_grown_corpus_keeps_the_unchanged_shards(built, tmp_path):
    """--grow: samples appended to the corpus, or one edited, recompute only the shards they touch; the
    result is exactly the cache a fresh build of the new corpus writes."""
    root, model, corpus, key = built
    shutil.copytree(root / "cache", tmp_path / "cache")
    grown = make_corpus(count=18)  # the same 12 samples, then 6 more
    assert np.array_equal(grown.tokens[: len(corpus.tokens)], corpus.tokens)
    with pytest.raises(FeatureCacheError, match="--grow"):
        build_cache(tmp_path / "cache", model, grown.tokens, grown.offsets, key_for(model, grown), shard_tokens=60,
                    batch_tokens=64, progress=False)
    old_shards = len(json.loads((root / "cache" / "manifest.json").read_text())["shards"])
    stats = build_cache(tmp_path / "cache", model, grown.tokens, grown.offsets, key_for(model, grown),
                        shard_tokens=60, batch_tokens=64, progress=False, grow=True)
    fresh = tmp_path / "fresh"
    build_cache(fresh, model, grown.tokens, grown.offsets, key_for(model, grown), shard_tokens=60, batch_tokens=64,
                progress=False)
    fresh_manifest = json.loads((fresh / "manifest.json").read_text())
    assert stats.shards_before >= old_shards - 1 and stats.shards_written < len(fresh_manifest["shards"])
    assert json.loads((tmp_path / "cache" / "manifest.json").read_text())["shards"] == fresh_manifest["shards"]
    FeatureCache.open(tmp_path / "cache", key_for(model, grown))  # complete, current, every digest checked

    edited = make_corpus(count=18)
    edited.tokens[int(edited.offsets[1]) + 1] += 1  # one token of sample 1: its shard, and only it, is redone
    stats = build_cache(tmp_path / "cache", model, edited.tokens, edited.offsets, key_for(model, edited),
                        shard_tokens=60, batch_tokens=64, progress=False, grow=True)
    assert stats.shards_written == 1
    rebuilt = FeatureCache.open(tmp_path / "cache", key_for(model, edited))
    start = int(edited.offsets[1])
    ids = torch.from_numpy(edited.tokens[start : start + rebuilt.length(1)].astype(np.int64))[None]
    with torch.no_grad():
        expected = model(ids).logits[0].topk(key.top_k, -1).indices
    assert torch.equal(rebuilt.sample(1).topk_ids, expected)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_corrupt_cache_is_refused(built, tmp_path, damage):
    import shutil

    root, model, corpus, key = built
    shutil.copytree(root / "cache", tmp_path / "cache")
    path = tmp_path / "cache" / "shard_00001" / "hidden.npy"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        expected = "checksum mismatch"
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) - 7]))
        expected = "truncated"
    elif damage == "delete":
        path.unlink()
        expected = "missing"
    else:
        (tmp_path / "cache" / "manifest.json").write_text("{not json")
        expected = "not a feature-cache manifest"
    with pytest.raises(FeatureCacheError, match=expected):
        FeatureCache.open(tmp_path / "cache", key)


def test_topk_loss_is_the_full_loss_when_k_is_the_vocabulary():
    torch.manual_seed(0)
    vocab, gamma = 11, 3
    logits = torch.randn(2, 4, gamma, vocab) * 2
    target_logits = torch.randn(2, 4, gamma, vocab) * 2
    labels = torch.randint(0, vocab, (2, 4, gamma))
    valid = torch.rand(2, 4, gamma) > 0.2
    confidence = torch.randn(2, 4, gamma)
    weights = LossWeights(0.1, 0.9, 1.0)
    full = block_loss(logits, target_logits, labels, valid, confidence, weights)
    values, ids = target_logits.topk(vocab, -1)
    teacher = TopKTeacher(ids, values, target_logits.logsumexp(-1))
    topk = topk_block_loss(logits, teacher, labels, valid, confidence, weights)
    for name in ("total", "ce", "tv", "conf", "accept"):
        torch.testing.assert_close(getattr(topk, name), getattr(full, name), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(topk.soft_label, full.soft_label, rtol=1e-5, atol=1e-6)
    # positions that are not valid count for nothing: garbage there changes neither the loss nor the gradient
    garbage = torch.where(valid[..., None], logits, torch.full_like(logits, 1e4)).requires_grad_()
    clean = logits.clone().requires_grad_()
    for tensor in (garbage, clean):
        topk_block_loss(tensor, teacher, labels, valid, confidence, weights).total.backward()
    torch.testing.assert_close(garbage.grad, clean.grad)
    assert not garbage.grad[~valid].any()
    # a smaller k only coarsens the vocabulary: the L1 distance can only shrink
    small = topk_block_loss(logits, TopKTeacher(ids[..., :3], values[..., :3], teacher.logsumexp), labels, valid,
                            confidence, weights)
    assert small.tv <= full.tv + 1e-6
    # greedy acceptance compares argmaxes
    assert torch.equal(greedy_accepts(logits, teacher, None), logits.argmax(-1) == target_logits.argmax(-1))


@pytest.mark.parametrize("teacher_kind", ["topk", "full"])
@pytest.mark.parametrize("global_normalizer", [False, True])
def test_chunked_loss_equals_the_whole_batch_loss_and_its_gradient(teacher_kind, global_normalizer):
    """Chunks of anchors (each with its own small fp32 temporaries) sum to the whole batch's loss terms,
    gradients and soft labels, for both teachers, with the local or a given (data-parallel) normaliser."""
    torch.manual_seed(3)
    vocab, gamma, anchors = 13, 3, 7
    logits = torch.randn(2, anchors, gamma, vocab) * 2
    target_logits = torch.randn(2, anchors, gamma, vocab) * 2
    labels = torch.randint(0, vocab, (2, anchors, gamma))
    valid = torch.rand(2, anchors, gamma) > 0.3
    confidence = torch.randn(2, anchors, gamma)
    values, ids = target_logits.topk(5, -1)
    teacher = (TopKTeacher(ids, values, target_logits.logsumexp(-1)) if teacher_kind == "topk" else target_logits)
    loss_fn = topk_block_loss if teacher_kind == "topk" else block_loss
    normalizer = torch.tensor(9.5) if global_normalizer else None
    weights = LossWeights(0.1, 0.9, 1.0)

    def run(chunk_bytes):
        leaf, conf = logits.clone().requires_grad_(), confidence.clone().requires_grad_()
        out = chunked_block_loss(loss_fn, leaf, labels, valid, conf, 4.0, normalizer, teacher=teacher,
                                 weights=weights, chunk_bytes=chunk_bytes)
        out.total.backward()
        return out, leaf.grad, conf.grad

    whole, whole_grad, whole_conf_grad = run(2**30)
    reference = loss_fn(logits, teacher, labels, valid, confidence, weights, 4.0, normalizer)
    torch.testing.assert_close(whole.total, reference.total)
    per_anchor = 2 * gamma * vocab * 4
    for chunk_bytes in (1, 2 * per_anchor, 3 * per_anchor):  # 7 chunks of 1 anchor, 4 of 2, 3 of 3
        out, grad, conf_grad = run(chunk_bytes)
        for name in ("total", "ce", "tv", "conf", "accept", "weight_sum"):
            torch.testing.assert_close(getattr(out, name), getattr(whole, name), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.soft_label, whole.soft_label)
        torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(conf_grad, whole_conf_grad, rtol=1e-5, atol=1e-7)


def test_topk_loss_with_a_reduced_draft_vocabulary():
    """Draft logits over a subset: CE only where the label is nameable, q = 0 outside the subset."""
    vocab = 6
    subset = torch.tensor([1, 3, 4])
    t2d = torch.full((vocab,), -1)
    t2d[subset] = torch.arange(3)
    target_logits = torch.tensor([[[0.0, 2.0, 0.0, 1.0, 0.5, 0.0]]])
    draft_logits = torch.tensor([[[1.0, 0.0, -1.0]]])
    values, ids = target_logits.topk(vocab, -1)
    teacher = TopKTeacher(ids, values, target_logits.logsumexp(-1))
    q = torch.zeros(vocab)
    q[subset] = draft_logits[0, 0].softmax(-1)
    p = target_logits[0, 0].softmax(-1)
    out = topk_block_loss(draft_logits, teacher, torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool),
                          weights=LossWeights(1.0, 1.0, 0.0), target_to_draft=t2d)
    assert out.ce.item() == 0.0  # label 0 is outside the subset
    assert out.tv.item() == pytest.approx(float((q - p).abs().sum()), rel=1e-5)
    named = topk_block_loss(draft_logits, teacher, torch.tensor([[3]]), torch.ones(1, 1, dtype=torch.bool),
                            weights=LossWeights(1.0, 0.0, 0.0), target_to_draft=t2d)
    assert named.ce.item() == pytest.approx(-float(q[3].log()), rel=1e-5)
    assert torch.equal(greedy_accepts(draft_logits, teacher, subset), torch.tensor([[True]]))


def test_cached_batch_gathers_the_teacher_at_block_positions(built):
    root, model, corpus, key = built
    cache = FeatureCache.open(root / "cache", key)
    examples = cached_examples(corpus, cache)
    batch = make_cached_batch(examples[:3], cache, LAYERS, [0, 1, 2], num_anchors=5, block_size=3, pad_id=0,
                              device=torch.device("cpu"))
    row, block, k = 1, 2, 1
    anchor = int(batch.anchors[row, block])
    sample = cache.sample(examples[row].index)
    assert torch.equal(batch.teacher.ids[row, block, k], sample.topk_ids[anchor + k])
    assert torch.equal(batch.features[row, : sample.hidden.shape[0]], sample.hidden)
    mask = answer_mask(corpus)
    assert mask.sum() == corpus.num_answer_tokens
    counts = token_counts(corpus, 96)
    assert counts.sum() == corpus.num_answer_tokens and counts[2] == corpus.num_samples  # one EOS per answer


def cached_config(root, out, **fields):
    from dspark.train.config import TrainConfig

    values = dict(target=str(root / "target"), data=str(root / "corpus.safetensors"),
                  feature_cache=str(root / "cache"), batch_size=4, anchors_per_seq=6, block_size=4, markov_rank=8,
                  max_steps=6, warmup_steps=2, save_every=3, eval_every=3, heldout_fraction=0.2, progress=False,
                  threads=1, keep_checkpoints=0, output_dir=str(root / out), target_layer_ids=[0, 2],
                  mask_token_id=5)
    values.update(fields)
    return TrainConfig(**values)


@pytest.fixture(scope="module")
def cached_run(tmp_path_factory):
    """A target on disk, its corpus file and its feature cache, as `dspark train` reads them."""
    root = tmp_path_factory.mktemp("cached_run")
    model = tiny_model("llama", num_layers=4)
    model.save_pretrained(root / "target")
    corpus = make_corpus(count=20)
    save_corpus(root / "corpus.safetensors", corpus)
    from dspark.loading import load_target

    target = load_target(str(root / "target"))
    key = CacheKey(target.name, model_fingerprint(target.model), LAYERS, "float32", 8, 32, corpus.checksum)
    build_cache(root / "cache", target.model, corpus.tokens, corpus.offsets, key, shard_tokens=100, progress=False)
    return root


class Killed(Exception):
    pass


def test_cached_training_resumes_exactly(cached_run):
    """Batches grouped by length (the shipped config's data order) are a function of the step too."""
    root = cached_run
    full = train(cached_config(root, "full", length_grouping=2))
    assert full["eval_tau"] >= 1.0 and 1.0 <= full["eval_tau_greedy"] <= 5.0
    reference = load_file(str(root / "full" / "final" / "model.safetensors"))

    def kill(step, metrics):
        if step == 4:
            raise Killed

    with pytest.raises(Killed):
        train(cached_config(root, "interrupted", length_grouping=2), on_step=kill)
    assert [p.name for p in checkpoints(root / "interrupted")] == ["checkpoint-0000003"]
    assert torch.load(root / "interrupted" / "checkpoint-0000003" / STATE_FILE, weights_only=True)["step"] == 3
    train(cached_config(root, "interrupted", length_grouping=2), resume="latest")
    resumed = load_file(str(root / "interrupted" / "final" / "model.safetensors"))
    for name in reference:
        assert torch.equal(reference[name], resumed[name]), name


def test_cached_training_learns(cached_run):
    result = train(cached_config(cached_run, "learn", max_steps=40, save_every=40, eval_every=40, lr=3e-3,
                                 ce_weight=1.0))
    first = json.loads((cached_run / "learn" / "train_log.jsonl").read_text().splitlines()[0])
    assert result["ce"] < 0.5 * first["ce"]


def test_cached_training_refuses_a_stale_cache(cached_run, tmp_path):
    other = make_corpus(count=20, seed=3)
    save_corpus(tmp_path / "other.safetensors", other)
    with pytest.raises(FeatureCacheError, match="stale.*corpus_checksum"):
        train(cached_config(cached_run, "stale", data=str(tmp_path / "other.safetensors")))
    with pytest.raises(FeatureCacheError, match="caches target layers"):
        train(cached_config(cached_run, "layers", target_layer_ids=[1]))


def test_bench_train_reports_both_pipelines(cached_run):
    from dspark.loading import load_target
    from dspark.train.bench_train import bench_train
    from dspark.train.corpus import load_corpus

    config = cached_config(cached_run, "bench", batch_size=2)
    result = bench_train(config, load_corpus(cached_run / "corpus.safetensors"),
                         load_target(str(cached_run / "target")), samples=4, steps=1, top_k=8, max_len=32,
                         profile=3)
    assert result["online_tokens_per_s"] > 0 and result["cached_tokens_per_s"] > 0
    assert result["online_topk_tokens_per_s"] > 0
    assert result["cache_break_even_epochs"] is None or result["cache_break_even_epochs"] > 0
    shares = [row["share"] for row in result["profile"]]
    assert len(shares) == 3 and shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1
    assert result["speedup"] == pytest.approx(result["cached_tokens_per_s"] / result["online_tokens_per_s"], rel=0.05)
    assert result["supervised_per_step"] > 0 and result["draft_vocab_coverage"] is None


def test_cached_training_with_the_last_context_input(cached_run):
    """The projection starts at zero (step 0 is the plain drafter), is trained, and is saved with its flag."""
    from dspark.drafters.checkpoint import load_model

    result = train(cached_config(cached_run, "fused", last_context_input=True, max_steps=3, save_every=3,
                                 eval_every=3))
    assert result["eval_tau_greedy"] >= 1.0
    model = load_model(cached_run / "fused" / "final", dtype=torch.float32)
    assert model.config.last_context_input and model.last_context_proj.weight.abs().sum() > 0


def test_cached_training_with_a_reduced_draft_vocabulary(cached_run):
    """The draft vocabulary is the most frequent answer tokens; the checkpoint carries it and loads
    for inference with the same subset."""
    from dspark.drafters.checkpoint import load_model
    from dspark.train.corpus import load_corpus

    result = train(cached_config(cached_run, "reduced", draft_vocab_size=40, max_steps=3, save_every=3,
                                 eval_every=3))
    assert result["eval_tau_greedy"] >= 1.0
    model = load_model(cached_run / "reduced" / "final", dtype=torch.float32)
    counts = token_counts(load_corpus(cached_run / "corpus.safetensors"), 96)
    ids = model.draft_to_target()
    assert len(ids) == 40 and model.reduced_vocab
    most = np.argsort(-counts, kind="stable")[:20]
    assert set(most.tolist()) <= set(ids.tolist())


def test_refresh_draft_vocab_chooses_it_again_and_carries_the_trained_rows(cached_run):
    """A checkpoint whose draft vocabulary was chosen on another corpus (here: rare ids) gets this corpus's
    most frequent answer tokens, at another size; ids it keeps keep their trained Markov rows, new ids start
    at zero, every other weight is the checkpoint's, and the refreshed drafter trains and saves."""
    from dspark.drafters.checkpoint import load_model
    from dspark.train.corpus import load_corpus
    from dspark.train.drafter_specs import _dspark_save
    from dspark.train.trainer import _prepare, setup

    train(cached_config(cached_run, "to_refresh", draft_vocab_size=40, max_steps=3, save_every=3, eval_every=3))
    stale = load_model(cached_run / "to_refresh" / "final", dtype=torch.float32)
    counts = token_counts(load_corpus(cached_run / "corpus.safetensors"), 96)
    by_frequency = np.argsort(-counts, kind="stable")
    stale.set_draft_vocab(torch.as_tensor(np.concatenate([by_frequency[:10], by_frequency[-30:]])))
    torch.manual_seed(0)
    with torch.no_grad():
        stale.markov_head.markov_w2.weight.copy_(torch.randn_like(stale.markov_head.markov_w2.weight))
    _dspark_save(stale, cached_run / "stale", torch.float32)

    config = cached_config(cached_run, "refreshed", init_from=str(cached_run / "stale"), draft_vocab_size=48,
                           refresh_draft_vocab=True, max_steps=2, save_every=2, eval_every=2)
    d = _prepare(config)
    drafter = setup(config, d).drafter
    d.close()
    ids = drafter.draft_to_target()
    assert len(ids) == 48 and set(by_frequency[:30].tolist()) <= set(ids.tolist())
    old_row = {int(t): row for t, row in zip(stale.draft_to_target(), stale.markov_head.markov_w2.weight, strict=True)}
    for row, target_id in zip(drafter.markov_head.markov_w2.weight, ids.tolist(), strict=True):
        assert torch.equal(row, old_row[target_id]) if target_id in old_row else not row.any()
    assert torch.equal(drafter.fc.weight, stale.fc.weight)
    assert train(config)["eval_tau_greedy"] >= 1.0
    saved = load_model(cached_run / "refreshed" / "final", dtype=torch.float32)
    assert torch.equal(saved.draft_to_target(), ids)
    with pytest.raises(DsparkError, match="refresh_draft_vocab"):
        cached_config(cached_run, "x", refresh_draft_vocab=True, draft_vocab_size=48)  # no init_from


def test_heldout_samples_are_the_ones_training_holds_out(built):
    from dspark.train.cached_data import heldout_samples, split_by_id

    root, model, corpus, key = built
    examples = cached_examples(corpus, FeatureCache.open(root / "cache", key))
    _, eval_ids = split_by_id([e.sample_id for e in examples], 0.25, 3)
    assert eval_ids and heldout_samples(corpus, key.max_len, 0.25, 3) == [examples[i].index for i in eval_ids]


def test_the_heldout_split_survives_corpus_growth():
    """A sample keeps its side when the corpus grows, so a drafter continued on the grown corpus is never
    evaluated on answers it trained on; the fraction is met on average, and both sides are never empty."""
    from dspark.train.cached_data import split_by_id

    small = [f"sharegpt/{i}" for i in range(300)]
    grown = small + [f"code/{i}" for i in range(2700)]
    _, held_small = split_by_id(small, 0.05, 0)
    _, held_grown = split_by_id(grown, 0.05, 0)
    assert [i for i in held_grown if i < len(small)] == held_small
    assert 0.03 < len(held_grown) / len(grown) < 0.07
    assert split_by_id(["a", "b"], 0.0001, 0)[1] and split_by_id(["a", "b"], 0.9999, 0)[0]
    assert split_by_id(small, 0.05, 1)[1] != held_small  # the seed matters


# ---------------------------------------------------------------- online features (no cache on disk)


def test_online_features_equal_the_cache(cached_run):
    """The target computing a batch's features and top-k teacher gives the batch the cache gives."""
    from dspark.loading import load_target
    from dspark.train.corpus import load_corpus
    from dspark.train.online_features import TargetFeatureSource

    corpus = load_corpus(cached_run / "corpus.safetensors")
    cache = FeatureCache.open(cached_run / "cache")
    online = TargetFeatureSource(load_target(str(cached_run / "target")).model, corpus, top_k=8, max_len=32, pad_id=0)
    examples = cached_examples(corpus, cache)
    assert [e.input_ids for e in cached_examples(corpus, online)] == [e.input_ids for e in examples]
    picked = [examples[i] for i in (0, 3, 7, 11)]  # different lengths: padded rows
    read, computed = (make_cached_batch(picked, source, (2, 0), [1, 2, 3, 4], num_anchors=6, block_size=4,
                                        pad_id=0, device=torch.device("cpu")) for source in (cache, online))
    assert torch.equal(read.anchors, computed.anchors) and torch.equal(read.keep, computed.keep)
    torch.testing.assert_close(computed.features.float(), read.features.float(), rtol=1e-2, atol=1e-2)
    assert computed.features.dtype == torch.bfloat16
    assert torch.equal(computed.teacher.ids, read.teacher.ids)
    torch.testing.assert_close(computed.teacher.logits, read.teacher.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(computed.teacher.logsumexp, read.teacher.logsumexp, rtol=1e-4, atol=1e-4)
    with pytest.raises(FeatureCacheError, match="do not fit a 4-layer target"):
        online.samples([0], (4,))


def test_online_training_is_the_cached_training(cached_run):
    """Same corpus, split, anchors and loss: the online run ends where the cached one does (bitwise here;
    the tolerance allows the float noise of a differently padded target forward, ~30x below what a top-4
    teacher instead of top-8 moves the weights), and it resumes exactly."""
    online = dict(feature_cache=None, online_features=True, top_k=8, seq_len=32)
    cached = train(cached_config(cached_run, "cached_ref"))
    result = train(cached_config(cached_run, "online", **online))
    assert result["eval_blocks"] == cached["eval_blocks"]
    assert "eval_rollout_tau" not in result  # 6 anchors a sequence: no rollout path to follow
    assert result["eval_tau_greedy"] == pytest.approx(cached["eval_tau_greedy"], abs=0.05)
    assert result["eval_loss"] == pytest.approx(cached["eval_loss"], rel=1e-2)
    reference = load_file(str(cached_run / "cached_ref" / "final" / "model.safetensors"))
    weights = load_file(str(cached_run / "online" / "final" / "model.safetensors"))
    for name in reference:
        torch.testing.assert_close(weights[name].float(), reference[name].float(), rtol=0, atol=1e-4)

    def kill(step, metrics):
        if step == 4:
            raise Killed

    with pytest.raises(Killed):
        train(cached_config(cached_run, "online_cut", **online), on_step=kill)
    train(cached_config(cached_run, "online_cut", **online), resume="latest")
    resumed = load_file(str(cached_run / "online_cut" / "final" / "model.safetensors"))
    for name in weights:
        assert torch.equal(weights[name], resumed[name]), name


def corpus_of(corpus: Corpus, indices: list[int], sources: list[int] | None = None) -> Corpus:
    """The samples `indices` of `corpus`, in that order (under the given source indices)."""
    pieces = [corpus.tokens[corpus.offsets[i] : corpus.offsets[i + 1]] for i in indices]
    offsets = np.cumsum([0] + [len(piece) for piece in pieces])
    names = sorted(set(sources)) if sources else [0]
    return Corpus(np.concatenate(pieces), offsets.astype(np.int64), corpus.prompt_lengths[indices],
                  corpus.finished[indices], np.array(sources or [0] * len(indices), dtype=np.uint8),
                  [corpus.ids[i] for i in indices], [f"source{n}" for n in names], dict(corpus.meta))


def test_score_reads_what_the_heldout_evaluation_read(cached_run):
    """`dspark train --score` on a corpus of the held-out samples gives the trainer's own final held-out
    metrics for the checkpoint it wrote (float32 weights: the same numbers), overall and, over two sources,
    per source; every anchor is scored (anchors_per_seq above the longest answer)."""
    from dspark.train.corpus import load_corpus
    from dspark.train.trainer import score, split_examples

    online = dict(feature_cache=None, online_features=True, top_k=8, seq_len=32, anchors_per_seq=32,
                  save_dtype="float32")
    trained = train(cached_config(cached_run, "to_score", **online))
    corpus = load_corpus(cached_run / "corpus.safetensors")
    examples = cached_examples(corpus, FeatureCache.open(cached_run / "cache"))
    held = [examples[i].index for i in split_examples(cached_config(cached_run, "x", **online), examples)[1]]
    assert len(held) >= 3
    save_corpus(cached_run / "held.safetensors", corpus_of(corpus, held, [k % 2 for k in range(len(held))]))
    scored = score(cached_config(cached_run, "unused", **online, data=str(cached_run / "held.safetensors"),
                                 init_from=str(cached_run / "to_score" / "final")))
    for name in ("eval_loss", "eval_ce", "eval_tau", "eval_tau_greedy", "eval_blocks", "eval_rollout_tau",
                 "eval_rollout_tau_greedy"):
        assert scored[name] == pytest.approx(trained[name], rel=1e-5), name
    assert scored["eval_rollout_tau_greedy"] >= 1.0 and scored["eval_rollout_tau"] >= 1.0
    parts = scored["sources"]
    assert sorted(parts) == ["source0", "source1"]
    assert sum(part["eval_blocks"] for part in parts.values()) == scored["eval_blocks"]
    mean_tau = sum(part["eval_tau"] * part["eval_blocks"] for part in parts.values()) / scored["eval_blocks"]
    assert mean_tau == pytest.approx(scored["eval_tau"], rel=1e-6)
    samples = scored["samples"]  # per-sample rollout-order sums, for paired resampling (dspark.eval.paired)
    assert sorted(samples) == sorted(corpus.ids[i] for i in held)
    assert {s["source"] for s in samples.values()} == {"source0", "source1"}
    for suffix in ("", "_greedy"):
        tokens = sum(s[f"chain_tokens{suffix}"] for s in samples.values())
        rounds = sum(s[f"chain_rounds{suffix}"] for s in samples.values())
        assert tokens / rounds == pytest.approx(scored[f"eval_rollout_tau{suffix}"], rel=1e-9)
    train(cached_config(cached_run, "to_score_early", **online, max_steps=1))  # another drafter: other numbers
    early = score(cached_config(cached_run, "unused", **online, data=str(cached_run / "held.safetensors"),
                                init_from=str(cached_run / "to_score_early" / "final")))
    assert early["eval_blocks"] == scored["eval_blocks"] and early["eval_loss"] != pytest.approx(scored["eval_loss"])


def test_score_needs_a_checkpoint_and_a_corpus(cached_run):
    from dspark.train.trainer import score

    online = dict(feature_cache=None, online_features=True, top_k=8, seq_len=32)
    with pytest.raises(DsparkError, match="init_from"):
        score(cached_config(cached_run, "unused", **online))
    with pytest.raises(DsparkError, match="reads a corpus"):
        score(cached_config(cached_run, "unused", data="chats.jsonl", feature_cache=None, init_from="somewhere"))
    with pytest.raises(DsparkError, match="as it is"):
        score(cached_config(cached_run, "unused", **online, init_from="somewhere", draft_vocab_size=40,
                            refresh_draft_vocab=True))


def test_online_features_need_a_corpus_and_no_cache():
    from dspark.errors import DsparkError
    from dspark.train.config import TrainConfig

    with pytest.raises(DsparkError, match="needs a corpus"):
        TrainConfig(data="chats.jsonl", online_features=True)
    with pytest.raises(DsparkError, match="not both"):
        TrainConfig(data="c.safetensors", online_features=True, feature_cache="cache")
    with pytest.raises(DsparkError, match="top_k"):
        TrainConfig(data="c.safetensors", online_features=True, top_k=0)


@pytest.mark.parametrize("draft_vocab_size", [None, 40])
@pytest.mark.parametrize("drafter_type,layers", [("eagle3", [0, 2, 3]), ("mtp", [3])])
def test_baselines_train_on_online_features(cached_run, drafter_type, layers, draft_vocab_size):
    """The budget-matched baselines (training/baselines.sh) train on the corpus pipeline too: full or
    reduced vocabulary, top-k teacher, the held-out T = 0 τ measured; the checkpoint drafts from the
    vocabulary the trainer chose (the most frequent answer tokens)."""
    from dspark.drafters import load_drafter
    from dspark.loading import load_target
    from dspark.train.corpus import load_corpus

    out = f"online_{drafter_type}_{draft_vocab_size}"
    result = train(cached_config(cached_run, out, drafter_type=drafter_type, draft_vocab_size=draft_vocab_size,
                                 target_layer_ids=layers, feature_cache=None, online_features=True, top_k=8,
                                 seq_len=32, max_steps=2, save_every=2, eval_every=2, num_draft_layers=1))
    assert result["loss"] == pytest.approx(result["ce"]) and result["conf"] == 0.0
    assert 1.0 <= result["eval_tau_greedy"] <= 5.0
    config = json.loads((cached_run / out / "final" / "config.json").read_text())
    assert config["dspark"]["drafter_type"] == drafter_type
    assert config.get("draft_vocab_size") == draft_vocab_size
    drafter = load_drafter(str(cached_run / out / "final"), load_target(str(cached_run / "target")).model)
    assert drafter.model.draft_vocab_size == (draft_vocab_size or 96)
    if draft_vocab_size:
        counts = token_counts(load_corpus(cached_run / "corpus.safetensors"), 96)
        most = np.argsort(-counts, kind="stable")[:20]
        assert set(most.tolist()) <= set(drafter.model.draft_to_target().tolist())


def test_split_seed_keeps_the_heldout_split_under_a_new_seed(cached_run):
    """A run continued on another seed (fresh data order) keeps the held-out answers of the run it continues
    with split_seed; without it the split moves (and answers held out before would be trained on)."""
    from dspark.train.trainer import split_examples

    examples = [CachedExample(i, [], 0, f"sample-{i}") for i in range(400)]
    base = split_examples(cached_config(cached_run, "x"), examples)
    assert split_examples(cached_config(cached_run, "x", seed=5, split_seed=0), examples) == base
    assert split_examples(cached_config(cached_run, "x", seed=5), examples)[1] != base[1]
    assert 0 < len(base[1]) < len(examples)
