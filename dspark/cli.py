"""`dspark` command line. Bad input exits non-zero with a one-line `error:` message."""

import argparse
import json
import os
import sys
from collections.abc import Callable

from dspark.cli_args import add_compile_arg, add_draft_gate_arg, add_dtype_arg
from dspark.drafters import DEFAULT_DRAFTER
from dspark.errors import DsparkError


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default",
                        help="HF model directory, offline hub id, GGUF file, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER,
                        help=f"none | ngram | default | PATH to a drafter checkpoint; default or PATH followed by "
                             f"+ngram drafts by prompt lookup where the text repeats (default: {DEFAULT_DRAFTER})")
    add_dtype_arg(parser)


def add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text with speculative decoding")
    add_model_args(parser)
    parser.add_argument("prompt", help="the user message (or raw text with --no-chat)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="most draft tokens verified per round (γ); default: the drafter's own, can only shrink it")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--json", action="store_true", help="print one JSON line with text, ids and stats last")
    parser.add_argument("--scheduler", default="dspark",
                        help="drafts verified per round, for drafters with confidences: dspark (Algorithm 1, "
                             "default) | fixed | fixed-<n> | threshold-<t>")
    add_draft_gate_arg(parser)
    add_compile_arg(parser)
    parser.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> None:
    from dspark.api import stream

    handle = stream(
        args.prompt, target=args.target, drafter=args.drafter, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        chat=not args.no_chat, stop=args.stop, block_size=args.block_size, scheduler=args.scheduler,
        dtype=args.dtype, draft_gate=args.draft_gate, compile=args.compile,
    )
    for delta in handle:
        if args.stream:
            print(delta, end="", flush=True)
    result = handle.result
    if args.stream:
        print()
    elif not args.json:
        print(result.text)
    stats = result.stats
    summary = (f"[dspark] {stats.num_generated} tokens, {stats.num_rounds} rounds, tau {stats.tau:.2f}, "
               f"{stats.tokens_per_s:.1f} tokens/s")
    print(summary, file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict()))


def add_bench_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks")
    bench = parser.add_subparsers(dest="bench", required=True)
    speed = bench.add_parser("speed", help="batch-1 greedy speed, all methods interleaved per prompt")
    speed.add_argument("--target", default="default")
    speed.add_argument("--drafter", action="append", default=None,
                       help="extra drafter(s) besides vanilla/ngram, SPEC or NAME=SPEC (repeatable)")
    speed.add_argument("--dataset", required=True, help="JSONL with {'turns': [...]} per line")
    speed.add_argument("--num-prompts", type=_positive_int, default=5)
    speed.add_argument("--max-new-tokens", type=_positive_int, default=128)
    speed.add_argument("--block-size", type=_positive_int, default=None)
    speed.add_argument("--prompt-lookup-num-tokens", type=_positive_int, default=10)
    speed.add_argument("--scheduler", default="fixed",
                       help="also run drafters that have confidences with this scheduler (e.g. dspark)")
    speed.add_argument("--json", action="store_true")
    speed.add_argument("--peer", action="append", default=None, choices=["llama.cpp"],
                       help="also run this runtime on the same prompts (llama.cpp: `pip install 'dspark[llamacpp]'`)")
    speed.add_argument("--peer-threads", type=_positive_int, action="append", default=None,
                       help="llama.cpp thread counts to run (repeatable; default 1 and all cores)")
    speed.add_argument("--peer-drafter", default=None,
                       help="DSpark checkpoint llama.cpp drafts with (converted to GGUF once; default: the shipped "
                            "drafter for the default target)")
    from dspark.peers.llamacpp import GGUF_KINDS

    speed.add_argument("--peer-gguf", default="native", choices=GGUF_KINDS,
                       help="target GGUF llama.cpp runs: native (the target's own, Q4_1 for the default) or the HF "
                            "weights converted to f32/bf16/f16 by llama.cpp's converter (once, cached)")
    add_dtype_arg(speed)
    speed.add_argument("--compile", action="store_true",
                       help="also run every one of our methods with the target's decode and verify steps "
                            "torch.compile'd, as extra rows NAME+compiled (compiled once, during the warm-up)")
    speed.set_defaults(handler=run_bench_speed)
    draft = bench.add_parser("draft", help="DSpark draft time per round vs one target verification forward")
    draft.add_argument("--target", default="default")
    draft.add_argument("--dataset", default=None, help="take the context from the first prompt of this JSONL")
    draft.add_argument("--block-size", type=_positive_int, default=7)
    draft.add_argument("--max-layers", type=_positive_int, default=5)
    draft.add_argument("--markov-rank", type=_positive_int, default=256)
    draft.add_argument("--repeats", type=_positive_int, default=30)
    draft.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="drafter dtype (auto: bf16 on CPUs with native bf16, else the target's)")
    add_dtype_arg(draft)
    draft.set_defaults(handler=run_bench_draft)
    load = bench.add_parser("load", help="throughput vs concurrency for every scheduling policy (engine)")
    load.add_argument("--target", default="default")
    load.add_argument("--drafter", default=DEFAULT_DRAFTER)
    load.add_argument("--dataset", action="append", default=None,
                      help="prompt JSONL (repeatable; default ../shared/eval_datasets/mt-bench.jsonl)")
    load.add_argument("--max-concurrency", type=_positive_int, default=8)
    load.add_argument("--num-requests", type=_positive_int, default=8)
    load.add_argument("--max-new-tokens", type=_positive_int, default=48)
    load.add_argument("--block-size", type=_positive_int, default=None)
    load.add_argument("--repeats", type=_positive_int, default=1,
                      help="passes over every policy per level, each in another rotated order; tokens/s is the "
                           "median of the passes (default 1)")
    load.add_argument("--policy", action="append", default=None,
                      help="scheduling policies to compare (repeatable; default: none, fixed-1/3/5/7, threshold, "
                           "dspark, dspark-async; dspark-planned on request); NAME:gate / NAME:no-gate runs a policy "
                           "with or without the draft gate (default: on for dspark*), e.g. dspark:no-gate")
    load.add_argument("--plot-dir", default=None, help="write load_frontier.png and load_budget.png here")
    load.add_argument("--gate-trace", default=None,
                      help="write every round the draft gates see (policy, concurrency, pass, requests, drafted, "
                           "tokens, seconds; or why it was not measured) here as JSON lines "
                           "(python scripts/gate_trace.py FILE summarises it)")
    load.add_argument("--json", action="store_true", help="(the JSON line is always printed last)")
    load.add_argument("--compile", action="store_true",
                      help="the target's decode and verify steps torch.compile'd, single requests and rounds of "
                           "several alike (compiled once, before the first timed pass)")
    add_dtype_arg(load)
    load.set_defaults(handler=run_bench_load)
    ragged = bench.add_parser("ragged", help="loop vs padded attention in the ragged batched forward")
    ragged.add_argument("--target", default="default")
    ragged.add_argument("--requests", type=_positive_int, nargs="+", default=[1, 4, 8, 16])
    ragged.add_argument("--context-tokens", type=_positive_int, nargs="+", default=[256, 1024])
    ragged.add_argument("--tokens-per-request", type=_positive_int, default=8)
    ragged.add_argument("--repeats", type=_positive_int, default=7)
    add_dtype_arg(ragged)
    ragged.set_defaults(handler=run_bench_ragged)
    forward = bench.add_parser("forward", help="cost of a k-token forward relative to one token, ours vs HF")
    forward.add_argument("--target", default="default")
    forward.add_argument("--tokens", type=_positive_int, nargs="+", default=[1, 2, 4, 8, 16],
                         help="new tokens per forward, one request")
    forward.add_argument("--rows", type=_positive_int, nargs="+", default=[8],
                         help="requests per batched forward, --batch-tokens each")
    forward.add_argument("--batch-tokens", type=_positive_int, default=8)
    forward.add_argument("--packed-weights", choices=("auto", "on", "off"), default="auto",
                         help="weights reordered once for oneDNN: auto = the engine's default (bf16 where native, "
                              "float32 where bf16 is not); on = always; packed forwards are also timed against plain "
                              "weights")
    forward.add_argument("--context-tokens", type=_positive_int, default=200)
    forward.add_argument("--repeats", type=_positive_int, default=15)
    add_dtype_arg(forward)
    forward.set_defaults(handler=run_bench_forward)
    from dspark.train.bench_train import add_bench_train_parser

    add_bench_train_parser(bench)


def run_bench_speed(args: argparse.Namespace) -> None:
    from dspark.bench import run_speed_bench

    run_speed_bench(args)


def run_bench_draft(args: argparse.Namespace) -> None:
    from dspark.bench import run_draft_bench

    run_draft_bench(args)


def run_bench_load(args: argparse.Namespace) -> None:
    from dspark.bench_load import run_load_bench, split_policy
    from dspark.eval.datasets import default_dataset
    from dspark.scheduler import get_scheduler

    for policy in args.policy or []:
        get_scheduler(split_policy(policy)[0])
    args.dataset = args.dataset or [str(default_dataset("mt-bench"))]
    run_load_bench(args)


def run_bench_ragged(args: argparse.Namespace) -> None:
    from dspark.bench_load import run_ragged_bench

    run_ragged_bench(args)


def run_bench_forward(args: argparse.Namespace) -> None:
    from dspark.bench_forward import run_forward_bench

    run_forward_bench(args)


# duplicates: one lazy wrapper per subcommand, so that only the command run imports its module (and the
# layering test sees each import) — kept apart on purpose
def add_report_parser(subparsers) -> None:
    from dspark.report import add_report_parser as add

    add(subparsers)


def add_data_parser(subparsers) -> None:
    from dspark.train.cli_data import add_data_parser as add

    add(subparsers)


def add_train_parser(subparsers) -> None:
    from dspark.train.cli_train import add_train_parser as add

    add(subparsers)


def add_calibrate_parser(subparsers) -> None:
    from dspark.train.calibrate import add_calibrate_parser as add

    add(subparsers)


def add_eval_parser(subparsers) -> None:
    from dspark.cli_eval import add_eval_parser as add

    add(subparsers)


def add_profile_parser(subparsers) -> None:
    parser = subparsers.add_parser("profile", help="measure the target's steps/s SPS_R(B) for B tokens over R requests")
    parser.add_argument("--target", default="default")
    parser.add_argument("--max-concurrency", type=_positive_int, default=8,
                        help="most requests in a round to profile (default 8)")
    parser.add_argument("--block-size", type=_positive_int, default=7, help="γ: a request sends up to γ + 1 tokens")
    parser.add_argument("--context-tokens", type=_positive_int, action="append",
                        help="cached context per request (repeatable; default 256)")
    add_dtype_arg(parser)
    add_compile_arg(parser)  # the compiled forward's rates, cached apart: what `generate --compile` schedules by
    parser.set_defaults(handler=run_profile)


def run_profile(args: argparse.Namespace) -> None:
    from dspark.loading import load_target, target_dtype_name
    from dspark.profiling import profile_path, round_cost

    loaded = load_target(args.target, args.dtype)
    profiles = {}
    for context in args.context_tokens or [256]:
        cost = round_cost(loaded, args.max_concurrency, args.block_size, context, refresh=True, compiled=args.compile)
        print(f"context {context} tokens -> {profile_path(loaded, context, args.compile)}", file=sys.stderr)
        for requests, table in sorted(cost.verify.items()):
            base = table(requests)
            for b in range(requests, requests * (args.block_size + 1) + 1):
                print(f"R={requests:<3d} B={b:<4d} SPS={table(b):8.2f}/s  step={1000 / table(b):7.2f} ms  "
                      f"relative cost={base / table(b):.3f}", file=sys.stderr)
        profiles[context] = {str(r): list(t.values) for r, t in sorted(cost.verify.items())}
    print(json.dumps({"target": loaded.name, "dtype": target_dtype_name(loaded.model), "sps_by_requests": profiles}))


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    parser.add_argument("--port", type=_positive_int, default=8000)
    parser.add_argument("--scheduler", default="dspark-async",
                        help="dspark | dspark-async (default: under load it skips drafting for rounds it will not "
                             "verify) | threshold[-t] | fixed | fixed-<n> | none")
    parser.add_argument("--max-concurrency", type=_positive_int, default=8, help="requests decoded together")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond that; more get 429")
    parser.add_argument("--block-size", type=_positive_int, default=None)
    parser.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $DSPARK_API_KEY, else no key)")
    parser.add_argument("--served-model-name", default=None, help="model id clients use (default: the target's)")
    parser.add_argument("--prefill-chunk", type=_positive_int, default=512,
                        help="most prompt tokens prefilled per round, next to decoding requests")
    parser.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    add_draft_gate_arg(parser)
    add_compile_arg(parser)
    parser.add_argument("--allowed-host", action="append", default=[], dest="allowed_hosts",
                        help="serve only this Host header (repeatable; '*.example.com' for subdomains)")
    from dspark.server.limits import add_limit_args

    add_limit_args(parser)
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> None:
    from dspark.scheduler import get_scheduler
    from dspark.server.app import build_server
    from dspark.server.limits import limits_from_args
    from dspark.server.run import draining_server

    get_scheduler(args.scheduler)
    if args.max_queue < 0:
        raise DsparkError(f"--max-queue must be >= 0, got {args.max_queue}")
    limits = limits_from_args(args)
    app = build_server(args.target, args.drafter, scheduler=args.scheduler, max_concurrency=args.max_concurrency,
                       max_queue=args.max_queue, block_size=args.block_size, api_key=args.api_key,
                       served_model_name=args.served_model_name, prefill_chunk=args.prefill_chunk, limits=limits,
                       public_metrics=args.public_metrics, allowed_hosts=tuple(args.allowed_hosts), dtype=args.dtype,
                       draft_gate=args.draft_gate, compile=args.compile)
    draining_server(app, args.host, args.port, limits.drain_timeout_s).run()
    print("[dspark] server drained and stopped", file=sys.stderr)


COMMANDS: list[Callable] = [add_generate_parser, add_serve_parser, add_bench_parser, add_profile_parser,
                            add_data_parser, add_train_parser, add_calibrate_parser, add_eval_parser,
                            add_report_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except DsparkError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
