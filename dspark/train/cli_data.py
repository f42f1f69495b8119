"""`dspark data prompts | regenerate`: build the training prompts, then answer them with the target."""

import argparse
import json
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
    regen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="target dtype for generation (bf16 is several times faster on CPUs with native bf16)")
    regen.set_defaults(handler=run_regenerate)


def run_prompts(args: argparse.Namespace) -> None:
    from dspark.train.data import build_prompts, write_prompts

    prompts, report = build_prompts(sharegpt=args.sharegpt, code=args.code, jsonl=args.jsonl,
                                    exclude=args.exclude, seed=args.seed, max_chars=args.max_chars)
    write_prompts(args.out, prompts)
    print(f"[dspark] {report.summary()}", file=sys.stderr)
    print(f"[dspark] wrote {len(prompts)} prompts to {args.out}; {report.excluded} dropped as evaluation matches",
          file=sys.stderr)


def run_regenerate(args: argparse.Namespace) -> None:
    import torch

    from dspark.errors import DsparkError
    from dspark.loading import load_target
    from dspark.train.data import read_jsonl_prompts
    from dspark.train.regenerate import SamplingConfig, recommended_sampling, regenerate

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.temperature is not None and args.temperature < 0:
        raise DsparkError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise DsparkError(f"--top-p must be in (0, 1], got {args.top_p}")
    prompts = read_jsonl_prompts(args.prompts)
    target = load_target(args.target, dtype=getattr(torch, args.dtype))
    if target.tokenizer is None:
        raise DsparkError(f"target {args.target!r} has no tokenizer")
    default = recommended_sampling(target.model)
    sampling = SamplingConfig(
        temperature=default.temperature if args.temperature is None else args.temperature,
        top_p=default.top_p if args.top_p is None else args.top_p,
        max_new_tokens=args.max_new_tokens,
    )
    print(f"[dspark] regenerating {len(prompts)} prompts with {target.name}: {sampling}", file=sys.stderr)
    stats = regenerate(prompts, args.out, target.model, target.tokenizer, sampling, batch_size=args.batch_size,
                       limit=args.limit, seed=args.seed)
    print(json.dumps(stats.to_dict()))
