"""`dspark bench train`: supervised tokens/s of the cached training pipeline against the online ones.

Both pipelines train the same drafter architecture on the same sequences with the same anchors, in
one process, one pipeline's steps after the other's, each after its own warm-up steps: interleaved step
by step, a cached step's page faults depended on what the online step had just freed (they share one
heap), which a real training run never sees (docs/training.md). The online pipeline runs
the frozen target on every batch and distils against its full-vocabulary softmax; the cached one
reads features and a top-k teacher from a feature cache (built here, for the benchmark's samples,
untimed — its cost is reported separately, once per corpus) and, when configured, predicts a reduced
draft vocabulary. A third pipeline, online top-k (`online_features`), trains exactly as the cached one but
has the target compute each batch's features and top-k teacher: from its rate and the cache's build rate
follows how many epochs a run must read before building a cache pays. The last line printed is JSON.
"""

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from dspark.train.anchors import anchor_seed
from dspark.train.cached_data import cached_examples
from dspark.train.config import TrainConfig
from dspark.train.distributed import Dist
from dspark.train.drafter_specs import DRAFTERS, BlockForward
from dspark.train.examples import Example
from dspark.train.feature_cache import CacheKey, FeatureCache, build_cache, model_fingerprint
from dspark.train.features import TargetFeatures
from dspark.train.online_features import TargetFeatureSource
from dspark.train.trainer import (
    Run,
    build_optimizer,
    choose_draft_vocab,
    loss_weights,
    step_batch_from_seeds,
    train_step,
)


def _pipeline(config: TrainConfig, target) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(config.seed)
    drafter = DRAFTERS[config.drafter_type].build(config, target.model).float().train()
    return drafter, BlockForward(drafter, DRAFTERS[config.drafter_type].blocks), build_optimizer(drafter, config)


def bench_train(config: TrainConfig, corpus, target, *, samples: int = 8, steps: int = 3, warmup: int = 1,
                top_k: int = 32, max_len: int = 1024, profile: int = 0) -> dict:
    """Time `steps` training steps (after `warmup`) of both pipelines on the first `samples` corpus samples;
    with `profile` > 0 also the costliest operators of one more cached step."""
    subset = corpus.select(list(range(min(samples, corpus.num_samples))))
    online_config = dataclasses.replace(config, feature_cache=None, draft_vocab_size=None)
    online_probe = _pipeline(online_config, target)
    layers = online_probe[0].config.target_layer_ids
    pad_id = target.tokenizer.pad_token_id if target.tokenizer is not None else 0
    pad_id = pad_id if pad_id is not None else 0
    with tempfile.TemporaryDirectory(prefix="dspark-bench-train-") as tmp:
        key = CacheKey(target.name, model_fingerprint(target.model), tuple(layers),
                       str(target.model.dtype).removeprefix("torch."), top_k, max_len, subset.checksum)
        started = time.perf_counter()
        build_cache(Path(tmp) / "cache", target.model, subset.tokens, subset.offsets, key, progress=False,
                    pad_id=pad_id)
        cache_seconds = time.perf_counter() - started
        cache = FeatureCache.open(Path(tmp) / "cache", key)
        cached_set = cached_examples(subset, cache)
        online_set = [Example(e.input_ids, e.answer_start) for e in cached_set]

        online_run = Run(online_config, Dist(), TargetFeatures(target.model, tuple(layers)),
                         loss_weights(online_config), pad_id, layer_ids=tuple(layers))
        online = online_probe

        cached_config = dataclasses.replace(config, feature_cache=str(Path(tmp) / "cache"))
        cached_run = Run(cached_config, Dist(), None, loss_weights(cached_config), pad_id, cache=cache,
                         layer_ids=tuple(layers))
        cached = _pipeline(cached_config, target)
        coverage = None
        if getattr(cached[0], "reduced_vocab", False):
            coverage = choose_draft_vocab(cached[0], corpus, target.tokenizer)
            cached_run.target_to_draft = cached[0].target_to_draft()
            cached_run.draft_to_target = cached[0].draft_to_target()

        topk_config = dataclasses.replace(config, feature_cache=None, online_features=True, top_k=top_k,
                                          seq_len=max_len)
        topk_run = dataclasses.replace(cached_run, config=topk_config,
                                       cache=TargetFeatureSource(target.model, subset, top_k, max_len, pad_id))
        topk = _pipeline(topk_config, target)
        if coverage is not None:
            topk[0].set_draft_vocab(cached[0].draft_to_target())

        timings = {"online": [0.0, 0], "cached": [0.0, 0], "online_topk": [0.0, 0]}
        batch_size = config.batch_size
        for name, run, pipeline, examples in (("online", online_run, online, online_set),
                                              ("cached", cached_run, cached, cached_set),
                                              ("online_topk", topk_run, topk, cached_set)):
            drafter, module, optimizer = pipeline
            for step in range(warmup + steps):
                first = (step * batch_size) % len(cached_set)
                indices = [(first + i) % len(cached_set) for i in range(batch_size)]
                seeds = [anchor_seed(config.seed, step, i) for i in range(batch_size)]
                started = time.perf_counter()
                batch = step_batch_from_seeds(run, [examples[i] for i in indices], seeds)
                _, valid, _ = train_step(run, batch, module, drafter, optimizer)
                elapsed = time.perf_counter() - started
                if step >= warmup:
                    timings[name][0] += elapsed
                    timings[name][1] += int(valid.sum())
        top_ops = profile_step(cached_run, cached, cached_set[:batch_size], seeds, profile) if profile else None
    online_rate, cached_rate, topk_rate = (timings[n][1] / timings[n][0] for n in ("online", "cached", "online_topk"))
    # one epoch supervises ~(supervised per sample) x samples positions; the cache costs cache_seconds once
    epoch = timings["cached"][1] / (steps * batch_size) * len(cached_set)
    saved_per_epoch = epoch / topk_rate - epoch / cached_rate
    return {
        "online_tokens_per_s": round(online_rate, 1), "cached_tokens_per_s": round(cached_rate, 1),
        "speedup": round(cached_rate / online_rate, 2), "online_topk_tokens_per_s": round(topk_rate, 1),
        "cache_break_even_epochs": round(cache_seconds / saved_per_epoch, 2) if saved_per_epoch > 0 else None,
        "supervised_per_step": timings["cached"][1] // steps,
        "batch_size": batch_size, "samples": len(cached_set), "steps": steps,
        "draft_vocab_size": config.draft_vocab_size, "draft_vocab_coverage": coverage,
        "cache_tokens_per_s": round(int(subset.tokens.shape[0]) / cache_seconds, 1),
        "threads": torch.get_num_threads(), "target_dtype": str(target.model.dtype).removeprefix("torch."),
        **({"profile": top_ops} if top_ops is not None else {}),
    }


def profile_step(run: Run, pipeline, examples: list, seeds: list[int], top: int) -> list[dict]:
    """The `top` operators of one cached training step by self CPU time (torch.profiler), with their share
    of the step: where the time goes when the speedup falls short."""
    from torch.profiler import ProfilerActivity, profile

    drafter, module, optimizer = pipeline
    batch = step_batch_from_seeds(run, examples, seeds)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(run, batch, module, drafter, optimizer)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1000, 2),
             "share": round(e.self_cpu_time_total / total, 3)} for e in events[:top]]


def add_bench_train_parser(bench) -> None:
    parser = bench.add_parser("train", help="training throughput: cached feature pipeline vs online target")
    parser.add_argument("--config", help="YAML of TrainConfig fields (the drafter and batch to compare)")
    parser.add_argument("--corpus", required=True, help="corpus file (`dspark data pack`)")
    parser.add_argument("--samples", type=int, default=8, help="corpus samples to train on")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per pipeline")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile one cached step and report its N costliest operators")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.set_defaults(handler=run_bench_train)


def run_bench_train(args) -> None:
    from dspark.errors import DsparkError
    from dspark.loading import load_target, resolve_dtype
    from dspark.train.config import load_config
    from dspark.train.corpus import load_corpus

    if args.samples < 1 or args.steps < 1 or args.profile < 0:
        raise DsparkError("--samples and --steps must be >= 1, --profile >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(args.config, args.overrides)
    corpus = load_corpus(args.corpus)
    target = load_target(config.target, dtype=resolve_dtype(config.target_dtype))
    result = bench_train(config, corpus, target, samples=args.samples, steps=args.steps, profile=args.profile)
    for key in ("online_tokens_per_s", "cached_tokens_per_s", "speedup", "online_topk_tokens_per_s",
                "cache_break_even_epochs"):
        print(f"{key:>22}: {result[key]}", file=sys.stderr)
    for row in result.get("profile", []):
        print(f"{row['share']:>7.1%} {row['self_ms']:>9.1f} ms {row['calls']:>6}×  {row['op']}", file=sys.stderr)
    print(json.dumps(result))
