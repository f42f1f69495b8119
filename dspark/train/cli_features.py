"""`dspark data features`: the offline target pass that fills the feature cache of a corpus."""

import argparse
import json
import sys


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_features_parser(commands) -> None:
    """Register `features` on the `dspark data` subcommands."""
    parser = commands.add_parser("features", help="cache the target's features and top-k teacher for a corpus "
                                                  "(resumable; training then never runs the target)")
    parser.add_argument("--corpus", required=True, help="corpus file (`dspark data pack`)")
    parser.add_argument("--out", required=True, help="cache directory (resumed when it holds a partial cache)")
    parser.add_argument("--target", default="default", help="HF model directory, hub id, GGUF file or 'default'")
    parser.add_argument("--layers", type=int, nargs="+", default=None, metavar="ID",
                        help="target layers to cache (DeepSpec ids; default: the DSpark default layers plus the "
                             "last layer)")
    parser.add_argument("--top-k", type=_positive_int, default=32, help="teacher tokens kept per position")
    parser.add_argument("--max-len", type=_positive_int, default=1024, help="tokens kept per sample")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="target dtype for the pass (auto: bf16 where the CPU has native bf16)")
    parser.add_argument("--shard-tokens", type=_positive_int, default=131072)
    parser.add_argument("--batch-tokens", type=_positive_int, default=4096, help="tokens per target forward")
    parser.add_argument("--max-shards", type=_positive_int, default=None, help="write at most N shards this run")
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    parser.add_argument("--grow", action="store_true",
                        help="the corpus grew (samples appended): keep the shards of its earlier version's cache "
                             "whose token ids are unchanged, compute the rest")
    parser.set_defaults(handler=run_features)


def default_cache_layers(num_layers: int) -> tuple[int, ...]:
    """The DSpark drafter's default layers plus the last one (MTP-style drafters read it)."""
    from dspark.drafters.dspark_config import default_target_layer_ids

    return tuple(sorted({*default_target_layer_ids(num_layers), num_layers - 1}))


def run_features(args: argparse.Namespace) -> None:
    import torch

    from dspark.loading import load_target, resolve_dtype
    from dspark.train.corpus import load_corpus
    from dspark.train.feature_cache import CacheKey, build_cache, model_fingerprint

    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = load_corpus(args.corpus)
    dtype = resolve_dtype(args.dtype)
    target = load_target(args.target, dtype=dtype)
    num_layers = int(target.model.config.get_text_config().num_hidden_layers)
    layers = tuple(args.layers) if args.layers else default_cache_layers(num_layers)
    key = CacheKey(target.name, model_fingerprint(target.model), layers, str(dtype).removeprefix("torch."),
                   args.top_k, args.max_len, corpus.checksum)
    tokenizer = target.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    print(f"[dspark] caching {corpus.num_samples} samples ({corpus.num_tokens} tokens) of {args.corpus}: "
          f"layers {list(layers)}, top-{args.top_k}, {key.dtype}", file=sys.stderr)
    stats = build_cache(args.out, target.model, corpus.tokens, corpus.offsets, key, shard_tokens=args.shard_tokens,
                        batch_tokens=args.batch_tokens, pad_id=pad_id, max_shards=args.max_shards,
                        grow=args.grow)
    from dspark.train.feature_cache import FeatureCache, FeatureCacheError

    summary = {"shards_before": stats.shards_before, "shards_written": stats.shards_written,
               "tokens": stats.tokens, "seconds": round(stats.seconds, 1),
               "tokens_per_s": round(stats.tokens_per_s, 1)}
    try:
        cache = FeatureCache.open(args.out, verify=False)
        summary.update(complete=True, bytes=cache.bytes_on_disk(),
                       bytes_per_million_tokens=round(cache.bytes_on_disk() / cache.num_tokens * 1e6))
    except FeatureCacheError:
        summary["complete"] = False
    print(json.dumps(summary))
