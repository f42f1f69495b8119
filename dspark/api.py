"""Text-level entry points: `generate` and `stream`, with chat templates and stop strings (`dspark.text`);
the engine comes from `dspark.factory`, as for every other entry point."""

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from dspark.drafters import DEFAULT_DRAFTER, Drafter, load_drafter
from dspark.engine import Engine, Request
from dspark.errors import DsparkError
from dspark.factory import build_engine
from dspark.loading import LoadedTarget, TargetSpec, load_target, resolve_dtype, target_dtype_name
from dspark.sampling import SamplingParams, make_generator
from dspark.scheduler import get_scheduler
from dspark.stats import GenerationStats
from dspark.text import Messages, TextAccumulator, eos_token_ids, prompt_ids, validate_prompt  # the server's too


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str = "length"
    dtype: str | None = None  #: the target's dtype, e.g. "bfloat16"

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "dtype": self.dtype,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "num_rounds": self.stats.num_rounds,
            "tau": round(self.stats.tau, 4),
            "tokens_per_s": round(self.stats.tokens_per_s, 3),
            "stats": self.stats.to_dict(),
        }


@functools.lru_cache(maxsize=2)
def _cached_target(spec: TargetSpec, dtype: torch.dtype | str) -> LoadedTarget:
    return load_target(spec, dtype)


def resolve(target: TargetSpec | LoadedTarget, drafter: str | Drafter,
            dtype: str | torch.dtype = "auto") -> tuple[LoadedTarget, Drafter]:
    """A target spec is loaded in `dtype` (once; `resolve_dtype` names); a loaded target keeps its own."""
    if isinstance(target, str):  # int4 stays a name (weights, not a torch dtype); the rest resolve to one
        loaded = _cached_target(target, dtype if dtype == "int4" else resolve_dtype(dtype))
    else:
        loaded = target
    if isinstance(drafter, str):
        drafter = load_drafter(drafter, loaded.model)
    return loaded, drafter


def _validate(max_new_tokens: int, block_size: int | None) -> None:
    if max_new_tokens <= 0:
        raise DsparkError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if block_size is not None and block_size < 0:
        raise DsparkError(f"block_size must be >= 0, got {block_size}")


@dataclass
class TextStream:
    """Iterator of text deltas; `result` holds the full GenerationResult once exhausted."""

    _deltas: Iterator[str]
    result: GenerationResult | None = field(default=None)

    def __iter__(self) -> Iterator[str]:
        return self._deltas


def stream(
    prompt: str | Messages,
    *,
    target: TargetSpec | LoadedTarget = "default",
    drafter: str | Drafter = DEFAULT_DRAFTER,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = 0,
    chat: bool = True,
    stop: list[str] | None = None,
    block_size: int | None = None,
    scheduler: str = "dspark",
    dtype: str | torch.dtype = "auto",
    draft_gate: bool | None = None,
    compile: bool = False,
) -> TextStream:
    """Generate with speculative decoding, yielding text as it is committed.

    `scheduler` picks how many of each round's drafts are verified: "dspark" (default: paper
    Algorithm 1 on the drafter's calibrated confidences and the target's step rate, profiled once and
    cached), "fixed" (all), "fixed-<n>" or "threshold-<t>" (prefix with survival a_k >= t).
    Drafters without confidences (n-gram, EAGLE-3, MTP, draft LM) always verify every draft.
    `dtype` applies when `target` is a spec: "auto" (bf16 where the hardware runs it natively, else
    float32), "float32", "bfloat16", "float16" or a torch dtype. `draft_gate` (None: on for "dspark") skips
    drafting in rounds where the engine measured plain decoding faster (`dspark.gate`); with a `seed`, sampled
    output follows the scheduler alone and repeats exactly. `compile`: run the target's decode and verify steps
    `torch.compile`d (`dspark.compiled`; about a minute of compiling first, worth it for long outputs).
    """
    sampling = SamplingParams(temperature, top_k, top_p)
    _validate(max_new_tokens, block_size)
    validate_prompt(prompt)
    get_scheduler(scheduler)
    loaded, drafter = resolve(target, drafter, dtype)
    engine = build_engine(loaded, drafter, scheduler=scheduler, block_size=block_size, draft_gate=draft_gate,
                          compile=compile)
    ids = prompt_ids(loaded, prompt, chat)
    request = Request(ids, max_new_tokens, sampling, make_generator(seed), eos_token_ids(loaded),
                      reproducible=seed is not None and not sampling.greedy)
    handle = TextStream(iter(()))
    handle._deltas = _run(handle, loaded, engine, request, stop or [])
    return handle


def _run(handle: TextStream, loaded: LoadedTarget, engine: Engine, request: Request,
         stop: list[str]) -> Iterator[str]:
    stats = request.stats
    chunks = engine.stream(request)
    text = TextAccumulator(loaded.tokenizer, stop)
    for chunk in chunks:
        delta = text.add(chunk)
        if delta:
            yield delta
        if text.stopped:
            break
    chunks.close()
    delta = text.flush()
    if delta:
        yield delta
    finish = "stop" if text.stopped else stats.finish_reason
    stats.finish_reason = finish
    stats.num_generated = len(text.tokens)
    handle.result = GenerationResult(text.text, text.tokens, stats, finish, target_dtype_name(loaded.model))


def generate(prompt: str | Messages, **options) -> GenerationResult:
    """Generate a whole answer; options as for `stream`."""
    handle = stream(prompt, **options)
    for _ in handle:
        pass
    assert handle.result is not None
    return handle.result
