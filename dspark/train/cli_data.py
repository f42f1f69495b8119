"""`dspark data prompts | regenerate | pack | info`: build the training prompts, answer them with the
target, pack the answers into a committed corpus file and verify it."""

import argparse
import json
import os
import sys


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_data_parser(subparsers) -> None:
    """Register `dspark data` and its subcommands on the top-level subparsers."""
    parser = subparsers.add_parser("data", help="training data: build prompts, regenerate answers with the target")
    commands = parser.add_subparsers(dest="data_command", required=True)

    prompts = commands.add_parser("prompts", help="build a deduplicated prompts JSONL, minus evaluation prompts")
    prompts.add_argument("--sharegpt", type=_count, default=0, help="number of ShareGPT prompts (random, seeded)")
    prompts.add_argument("--code", type=_count, default=0, help="number of Python standard-library code prompts")
    prompts.add_argument("--code-tasks", type=_count, default=0,
                         help="number of function-writing tasks from documented standard-library functions")
    prompts.add_argument("--math", type=_count, default=0, help="number of synthetic maths questions (templates)")
    prompts.add_argument("--math-advanced", type=_count, default=0,
                         help="number of competition-style maths questions (templates: precalculus, algebra, "
                              "geometry, number theory, counting)")
    prompts.add_argument("--writing", type=_count, default=0,
                         help="number of synthetic writing and role-play requests (templates)")
    prompts.add_argument("--jsonl", action="extend", nargs="+", default=[], metavar="FILE",
                         help='user prompts, one {"turns": [...]} or {"messages": [...]} per line (repeatable)')
    prompts.add_argument("--exclude", action="extend", nargs="+", default=[], metavar="FILE",
                         help="evaluation JSONL whose prompts must not be trained on (repeatable)")
    prompts.add_argument("--max-chars", type=_positive_int, default=2000, help="skip longer ShareGPT prompts")
    prompts.add_argument("--out", required=True, help="output prompts JSONL")
    prompts.add_argument("--seed", type=int, default=0)
    prompts.set_defaults(handler=run_prompts)

    regen = commands.add_parser("regenerate", help="answer prompts with the target (resumable)")
    regen.add_argument("--prompts", required=True, help="prompts JSONL (from `dspark data prompts` or user JSONL)")
    regen.add_argument("--out", required=True, help="output JSONL; appended to, already answered ids are skipped")
    regen.add_argument("--target", default="default", help="HF model directory, hub id, GGUF file or 'default'")
    regen.add_argument("--batch-size", type=_positive_int, default=8)
    regen.add_argument("--max-new-tokens", type=_positive_int, default=256)
    regen.add_argument("--temperature", type=float, default=None,
                       help="0 = greedy; default: the target's recommendation (SmolLM2: 0.2)")
    regen.add_argument("--top-p", type=float, default=None, help="default: the target's recommendation (SmolLM2: 0.9)")
    regen.add_argument("--limit", type=_positive_int, default=None, help="answer at most N more prompts in this run")
    regen.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    regen.add_argument("--seed", type=int, default=0)
    regen.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                       help="target dtype for generation (bf16 is several times faster on CPUs with native bf16; "
                            "auto: bf16 where the CPU has it natively). Default float32, the corpus's reference")
    regen.add_argument("--skip", action="append", default=[], metavar="CORPUS",
                       help="corpus (.safetensors) whose prompt ids are not regenerated (repeatable)")
    regen.set_defaults(handler=run_regenerate)

    from dspark.train.cli_features import add_features_parser

    add_features_parser(commands)

    pack = commands.add_parser("pack", help="pack regenerated JSONL into a compact corpus file (token ids)")
    pack.add_argument("--jsonl", action="extend", nargs="+", required=True, metavar="FILE",
                      help="regenerated JSONL from `dspark data regenerate` (repeatable)")
    pack.add_argument("--corpus", default=None, metavar="EXISTING",
                      help="an existing corpus to merge with (its samples come first and win on duplicate ids)")
    pack.add_argument("--out", required=True, help="output corpus (.safetensors), written atomically")
    pack.add_argument("--target", default="default",
                      help="the target that answered ('default' or its path/hub id; the model is not loaded)")
    pack.add_argument("--target-name", default=None, help="default: SmolLM2-135M-Instruct for 'default', else "
                      "the target's last path component")
    pack.add_argument("--vocab-size", type=_positive_int, default=None,
                      help="the target's vocabulary size (required unless --target default: 49152)")
    pack.add_argument("--target-revision", default=None,
                      help="which weights exactly; default: the package and GGUF of 'default', else --target")
    pack.add_argument("--temperature", type=float, default=None, help="sampling used to regenerate (default 0.2)")
    pack.add_argument("--top-p", type=float, default=None, help="sampling used to regenerate (default 0.9)")
    pack.add_argument("--max-new-tokens", type=_positive_int, default=256, help="sampling used to regenerate")
    pack.set_defaults(handler=run_pack)

    info = commands.add_parser("info", help="verify a corpus file and print its summary as JSON")
    info.add_argument("corpus", help="corpus (.safetensors)")
    info.set_defaults(handler=run_info)


def run_prompts(args: argparse.Namespace) -> None:
    from dspark.train.data import write_prompts
    from dspark.train.prompt_sources import build_prompts

    prompts, report = build_prompts(sharegpt=args.sharegpt, code=args.code, code_tasks=args.code_tasks,
                                    maths=args.math, advanced_maths=args.math_advanced,
                                    writing=args.writing, jsonl=args.jsonl,
                                    exclude=args.exclude, seed=args.seed, max_chars=args.max_chars)
    write_prompts(args.out, prompts)
    print(f"[dspark] {report.summary()}", file=sys.stderr)
    print(f"[dspark] wrote {len(prompts)} prompts to {args.out}; {report.excluded} dropped as evaluation matches",
          file=sys.stderr)


def run_regenerate(args: argparse.Namespace) -> None:
    import torch

    from dspark.errors import DsparkError
    from dspark.loading import load_target, resolve_dtype
    from dspark.train.prompt_sources import read_jsonl_prompts
    from dspark.train.regenerate import SamplingConfig, recommended_sampling, regenerate

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.temperature is not None and args.temperature < 0:
        raise DsparkError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise DsparkError(f"--top-p must be in (0, 1], got {args.top_p}")
    prompts = read_jsonl_prompts(args.prompts)
    target = load_target(args.target, dtype=resolve_dtype(args.dtype))
    if target.tokenizer is None:
        raise DsparkError(f"target {args.target!r} has no tokenizer")
    default = recommended_sampling(target.model)
    sampling = SamplingConfig(
        temperature=default.temperature if args.temperature is None else args.temperature,
        top_p=default.top_p if args.top_p is None else args.top_p,
        max_new_tokens=args.max_new_tokens,
    )
    skip_ids = skipped_ids(args.skip, target.name)
    print(f"[dspark] regenerating {len(prompts)} prompts with {target.name}: {sampling}", file=sys.stderr)
    stats = regenerate(prompts, args.out, target.model, target.tokenizer, sampling, batch_size=args.batch_size,
                       limit=args.limit, seed=args.seed, skip_ids=skip_ids)
    print(json.dumps(stats.to_dict()))


def skipped_ids(paths: list[str], target_name: str) -> set[str] | None:
    """Sample ids of the `--skip` corpora: a new machine continues from the committed corpus instead of
    answering its prompts again."""
    from dspark.train.corpus import load_corpus

    ids: set[str] = set()
    for path in paths:
        corpus = load_corpus(path)
        if corpus.meta["target"] != target_name:
            print(f"[dspark] warning: {path} was generated by {corpus.meta['target']}, not {target_name}",
                  file=sys.stderr)
        ids.update(corpus.ids)
    if paths:
        print(f"[dspark] skipping {len(ids)} prompt ids already in {', '.join(paths)}", file=sys.stderr)
    return ids or None


def run_pack(args: argparse.Namespace) -> None:
    from pathlib import Path

    from dspark.errors import DsparkError
    from dspark.loading import DEFAULT_NAME, DEFAULT_TARGET
    from dspark.train.corpus import (
        DEFAULT_REVISION,
        DEFAULT_VOCAB_SIZE,
        corpus_from_jsonl,
        load_corpus,
        merge,
        save_corpus,
    )
    from dspark.train.regenerate import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, SamplingConfig

    temperature = DEFAULT_TEMPERATURE if args.temperature is None else args.temperature
    top_p = DEFAULT_TOP_P if args.top_p is None else args.top_p
    if temperature < 0:
        raise DsparkError(f"--temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise DsparkError(f"--top-p must be in (0, 1], got {top_p}")
    if args.target in ("", DEFAULT_TARGET):
        name, vocab_size, revision = DEFAULT_NAME, DEFAULT_VOCAB_SIZE, DEFAULT_REVISION
    else:
        if args.vocab_size is None:
            raise DsparkError(f"--vocab-size is required for target {args.target!r} (the model is not loaded)")
        name, vocab_size, revision = Path(args.target).name or args.target, args.vocab_size, args.target
    corpus = corpus_from_jsonl(
        args.jsonl, target=args.target_name or name, target_revision=args.target_revision or revision,
        vocab_size=args.vocab_size or vocab_size,
        sampling=SamplingConfig(temperature, top_p, args.max_new_tokens),
    )
    if args.corpus:
        corpus = merge([load_corpus(args.corpus), corpus])
    if not corpus.num_samples:
        raise DsparkError(f"no samples with at least 2 answer tokens in {', '.join(args.jsonl)}")
    save_corpus(args.out, corpus)
    print(json.dumps({"path": args.out, "file_bytes": os.path.getsize(args.out), **corpus.summary()}))


def run_info(args: argparse.Namespace) -> None:
    from dspark.train.corpus import load_corpus

    corpus = load_corpus(args.corpus)
    print(json.dumps({"path": args.corpus, "file_bytes": os.path.getsize(args.corpus), **corpus.summary()}))
