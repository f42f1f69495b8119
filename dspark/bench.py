"""`dspark bench speed`: batch-1 greedy decoding, every method run on every prompt, interleaved, in
one process, so the reported ratios share the machine's conditions. Absolute times are not evidence
on shared machines; the ratios are."""

import argparse
import json
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from dspark.drafters import load_drafter
from dspark.engine import Request
from dspark.errors import DsparkError
from dspark.eval.datasets import load_prompts
from dspark.factory import build_engine, has_confidences, resolve_gate
from dspark.gate import DraftGate
from dspark.loading import LoadedTarget, TargetSpec, load_target, target_dtype_name
from dspark.sampling import SamplingParams
from dspark.stats import GenerationStats
from dspark.target import Target
from dspark.text import eos_token_ids, prompt_ids


# duplicates: same shape as stats.EngineStats and the other counter dataclasses, different fields — kept apart
@dataclass
class MethodTally:
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    accepted: int = 0
    identical: bool = True
    has_rounds: bool = False
    per_prompt: list[float] = field(default_factory=list)
    same_as_ours: list[bool] = field(default_factory=list)
    divergence_gaps: list[float | None] = field(default_factory=list)  # top-2 logit gap where it first differs

    def add(self, num_tokens: int, seconds: float, stats: GenerationStats | None, same: bool) -> None:
        self.tokens += num_tokens
        self.seconds += seconds
        self.identical &= same
        self.per_prompt.append(num_tokens / seconds if seconds else 0.0)
        if stats is not None:
            self.has_rounds = True
            self.rounds += stats.num_rounds
            self.accepted += sum(stats.accepted_per_round)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float | None:
        return (self.accepted + self.rounds) / self.rounds if self.has_rounds and self.rounds else None


def as_loaded(target: TargetSpec | LoadedTarget, dtype: str = "auto") -> LoadedTarget:
    """A target spec is loaded in `dtype`; an already loaded target (from `dspark report`) is reused."""
    return target if isinstance(target, LoadedTarget) else load_target(target, dtype)


def hf_generate(loaded: LoadedTarget, ids: torch.Tensor, max_new_tokens: int, **extra) -> list[int]:
    model = loaded.model
    with torch.inference_mode():
        output = model.generate(
            ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=loaded.tokenizer.pad_token_id or 0, **extra,
        )
    return output[0, ids.shape[0]:].tolist()


def ours(loaded: LoadedTarget, drafter, ids: torch.Tensor, max_new_tokens: int, block_size: int | None,
         scheduler: str = "fixed", gate: DraftGate | None = None,
         compile: bool = False) -> tuple[list[int], GenerationStats]:
    """One greedy generation of ours (the engine at concurrency 1): its tokens and stats. `gate`: the draft gate
    the method keeps from prompt to prompt, as one process serving them would (None: the scheduler's default)."""
    engine = build_engine(loaded, drafter, scheduler=scheduler, block_size=block_size, draft_gate=gate,
                          compile=compile)
    request = Request(ids, max_new_tokens, SamplingParams(), None, eos_token_ids(loaded))
    tokens = [token for chunk in engine.stream(request) for token in chunk]
    return tokens, request.stats


def divergence_gap(model, prompt: torch.Tensor, reference: list[int], tokens: list[int]) -> float | None:
    """Top-2 logit gap of the target (one teacher-forced forward) at the first position where `tokens`
    leaves `reference`: a greedy divergence that starts at a near-tie is floating-point rounding (a forward
    over a different number of tokens rounds differently in bf16), a large gap would be a bug. None if
    one output is a prefix of the other (a length difference, not a token choice)."""
    first = next((i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b), None)
    if first is None:
        return None
    ids = torch.cat([prompt, torch.tensor(reference[:first], dtype=prompt.dtype)])
    with torch.inference_mode():
        logits = model(input_ids=ids[None].to(model.device), logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def method_name(text: str) -> tuple[str, str]:
    """'NAME=SPEC' -> ('ours_NAME', SPEC); a bare spec is named after its last path component."""
    name, sep, spec = text.partition("=")
    if sep and name and spec and "/" not in name:
        return f"ours_{name}", spec
    return f"ours_{text.rstrip('/').split('/')[-1]}", text


def run_speed_bench(args: argparse.Namespace) -> dict:
    with ExitStack() as peers:  # peer servers stop when the benchmark ends, however it ends
        return _run_speed_bench(args, peers)


def _start_peers(args: argparse.Namespace, loaded: LoadedTarget, prompt_lengths: list[int], stack: ExitStack) -> dict:
    """The `--peer` methods (running servers), with a one-line note for each one that cannot run."""
    if "llama.cpp" not in (args.peer or []):
        return {}
    from dspark.peers.llamacpp import PeerSetup, llamacpp_methods

    spec = args.target if isinstance(args.target, str) else loaded.name
    setup = PeerSetup(spec, loaded.path, loaded.name, prompt_lengths, args.max_new_tokens, eos_token_ids(loaded),
                      lookup_tokens=args.prompt_lookup_num_tokens, threads=args.peer_threads,
                      drafter=args.peer_drafter, gguf=args.peer_gguf)
    methods, notes = llamacpp_methods(stack, setup)
    for note in notes:
        print(f"[bench] {note}", file=sys.stderr)
    return {"methods": methods, "notes": notes}


def _run_speed_bench(args: argparse.Namespace, stack: ExitStack) -> dict:
    loaded = as_loaded(args.target, args.dtype)
    prompts = load_prompts(args.dataset, args.num_prompts)
    drafters = {"ours_vanilla": load_drafter("none", loaded.model), "ours_ngram": load_drafter("ngram", loaded.model)}
    for text in args.drafter or []:
        name, spec = method_name(text)
        if name in drafters:
            raise DsparkError(f"two drafters are both named {name!r}: name them with NAME=SPEC")
        drafters[name] = load_drafter(spec, loaded.model)
    methods = {
        "hf_vanilla": lambda ids: (hf_generate(loaded, ids, args.max_new_tokens), None),
        "hf_prompt_lookup": lambda ids: (hf_generate(
            loaded, ids, args.max_new_tokens, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens), None),
    }
    for compiled in (False, True) if args.compile else (False,):
        suffix = "+compiled" if compiled else ""
        for name, drafter in drafters.items():
            methods[name + suffix] = lambda ids, d=drafter, c=compiled: ours(
                loaded, d, ids, args.max_new_tokens, args.block_size, compile=c)
            if args.scheduler != "fixed" and has_confidences(drafter):
                gate = resolve_gate(None, args.scheduler, drafter.max_block_size or 1)
                methods[f"{name}+{args.scheduler}{suffix}"] = lambda ids, d=drafter, g=gate, c=compiled: ours(
                    loaded, d, ids, args.max_new_tokens, args.block_size, args.scheduler, g, c)

    encoded = [prompt_ids(loaded, prompt) for prompt in prompts]
    peers = _start_peers(args, loaded, [len(ids) for ids in encoded], stack)
    methods.update(peers.get("methods", {}))

    warm = prompt_ids(loaded, "Hello")
    for run in methods.values():
        run(warm[:8])
    for peer in peers.get("methods", {}).values():
        peer.reset()
    tallies = {name: MethodTally() for name in methods}
    names = list(methods)
    for index, ids in enumerate(encoded):
        order = names[index % len(names):] + names[: index % len(names)]  # rotate to spread drift evenly
        outputs = {}
        timings = {}
        for name in order:
            start = time.perf_counter()
            outputs[name] = methods[name](ids)
            timings[name] = time.perf_counter() - start
        reference, ours_reference = outputs["hf_vanilla"][0], outputs["ours_vanilla"][0]
        for name in names:
            tokens, stats = outputs[name]
            tallies[name].add(len(tokens), timings[name], stats, tokens == reference)
            tallies[name].same_as_ours.append(tokens == ours_reference)
            if tokens != ours_reference and name.startswith("ours_"):
                tallies[name].divergence_gaps.append(divergence_gap(loaded.model, ids, ours_reference, tokens))
        print(f"[bench] prompt {index + 1}/{len(prompts)}: {len(ids)} prompt tokens, "
              f"{len(reference)} generated", file=sys.stderr)

    base = tallies["hf_vanilla"].tokens_per_s
    report = {
        "benchmark": "speed",
        "target": loaded.name,
        "dtype": target_dtype_name(loaded.model),
        "dataset": str(args.dataset),
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "block_size": args.block_size,
        "scheduler": args.scheduler,
        "torch_threads": torch.get_num_threads(),
        "methods": {
            name: {
                "tokens_per_s": round(t.tokens_per_s, 3),
                "speedup_vs_hf": round(t.tokens_per_s / base, 4) if base else None,
                "tau": None if t.tau is None else round(t.tau, 4),
                "identical_to_hf": t.identical,
                "identical_to_ours_vanilla": sum(t.same_as_ours) / len(t.same_as_ours) if t.same_as_ours else None,
                "divergence_gaps": [None if g is None else round(g, 4) for g in t.divergence_gaps],
                "tokens": t.tokens,
            }
            for name, t in tallies.items()
        },
    }
    if peers:
        report["peers"] = {"llama.cpp": _peer_report(peers["methods"], report["methods"], peers["notes"])}
    _print_table(report)
    print(json.dumps(report))
    return report


def _peer_report(methods: dict, rows: dict, notes: list[str]) -> dict:
    """Adds llama-server's own decode rate and draft acceptance to its rows; names the best of each kind."""
    from dspark.peers.llamacpp import best_per_kind

    for name, method in methods.items():
        rows[name].update(method.totals.to_dict(), threads=method.mode.threads)
    modes = {name: method.mode for name, method in methods.items()}
    best = best_per_kind(modes, {name: rows[name]["tokens_per_s"] for name in methods})
    gguf = str(next(iter(methods.values())).server.model_gguf) if methods else None
    return {"gguf": gguf, "best": best, "skipped": notes}


def _print_table(report: dict) -> None:
    print(f"{'method':<24}{'tok/s':>10}{'vs HF':>10}{'tau':>8}  identical to HF / share as ours_vanilla",
          file=sys.stderr)
    for name, row in report["methods"].items():
        tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
        share = row["identical_to_ours_vanilla"]
        gaps = ", ".join("-" if g is None else f"{g:.3f}" for g in row["divergence_gaps"])
        gaps = f" (top-2 logit gaps where it diverges: {gaps})" if gaps else ""
        print(f"{name:<24}{row['tokens_per_s']:>10.2f}{row['speedup_vs_hf']:>10.3f}{tau:>8}  "
              f"{row['identical_to_hf']!s:<6} {share:.2f}{gaps}", file=sys.stderr)
    for peer, summary in report.get("peers", {}).items():
        if summary["best"]:
            best = ", ".join(f"{kind} {name}" for kind, name in summary["best"].items())
            print(f"{peer} best: {best} (server decode rates in the JSON line)", file=sys.stderr)


def run_draft_bench(args: argparse.Namespace) -> dict:
    """Draft time per round (γ tokens) for each head type and depth, as a ratio to one target
    verification forward of γ+1 tokens, all timed interleaved in one run on the same context."""
    from dspark.drafters import default_draft_dtype
    from dspark.drafters.checkpoint import embeddings_in_dtype
    from dspark.drafters.dspark import DSparkModel
    from dspark.drafters.dspark_config import DSparkConfig
    from dspark.drafters.dspark_drafter import DSparkDrafter

    loaded = as_loaded(args.target, args.dtype)
    gamma = args.block_size or 7
    prompt = load_prompts(args.dataset, 1)[0] if args.dataset else "Write a Python function that reverses a string."
    ids = prompt_ids(loaded, prompt)
    dtype = getattr(torch, args.draft_dtype) if args.draft_dtype != "auto" else default_draft_dtype(loaded.model)
    embed, lm_head = embeddings_in_dtype(loaded.model.get_input_embeddings(),
                                         loaded.model.get_output_embeddings(), dtype)
    configs = {}
    for head in ("none", "vanilla", "rnn"):
        for depth in range(1, args.max_layers + 1):
            torch.manual_seed(0)
            config = DSparkConfig.for_target(loaded.model.config, num_hidden_layers=depth, block_size=gamma,
                                             markov_rank=args.markov_rank, markov_head_type=head)
            configs[f"{head}-{depth}L"] = DSparkDrafter(DSparkModel(config).to(dtype), embed, lm_head)
    layer_ids = next(iter(configs.values())).target_layer_ids
    target = Target(loaded.model, layer_ids)
    prefill = target.prefill(ids[:-1])
    states = {name: drafter.start(ids[:-1], prefill.hidden) for name, drafter in configs.items()}
    vocab = min(int(loaded.model.get_output_embeddings().weight.shape[0]), 1000)
    block = torch.cat([ids[-1:], torch.randint(0, vocab, (gamma,))])
    sampling = SamplingParams()
    times: dict[str, list[float]] = {name: [] for name in [*configs, "verify"]}
    for _ in range(args.repeats):
        start = time.perf_counter()
        target.extend(block)
        times["verify"].append(time.perf_counter() - start)
        target.rollback(ids.shape[0] - 1)
        for name, drafter in configs.items():
            start = time.perf_counter()
            drafter.propose(states[name], ids, gamma, sampling, None)
            times[name].append(time.perf_counter() - start)
    median = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
    verify_s = median["verify"]
    rows = {name: {"draft_ms": round(1000 * median[name], 3), "ratio_to_verify": round(median[name] / verify_s, 4)}
            for name in configs}
    for depth in range(1, args.max_layers + 1):
        base = median[f"none-{depth}L"]
        for head in ("vanilla", "rnn"):
            rows[f"{head}-{depth}L"]["head_overhead"] = round(median[f"{head}-{depth}L"] / base - 1, 4)
    report = {"benchmark": "draft", "target": loaded.name, "dtype": target_dtype_name(loaded.model),
              "block_size": gamma, "draft_dtype": str(dtype),
              "markov_rank": args.markov_rank, "context_tokens": int(ids.shape[0]),
              "verify_ms": round(1000 * verify_s, 3), "repeats": args.repeats, "drafters": rows}
    print(f"{'drafter':<14}{'draft ms':>10}{'/verify':>10}{'head +%':>10}", file=sys.stderr)
    for name, row in rows.items():
        overhead = row.get("head_overhead")
        extra = "" if overhead is None else f"{100 * overhead:>9.1f}%"
        print(f"{name:<14}{row['draft_ms']:>10.2f}{row['ratio_to_verify']:>10.3f}{extra}", file=sys.stderr)
    print(json.dumps(report))
    return report
