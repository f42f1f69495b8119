"""Text-level entry points: `generate` and `stream`, with chat templates and stop strings (`dspark.text`)."""

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from dspark.drafters import Drafter, load_drafter
from dspark.engine import TargetBackend, make_backend
from dspark.errors import DsparkError
from dspark.generation import GenerationStats, speculative_decode
from dspark.loading import LoadedTarget, dtype_name, load_target, resolve_dtype
from dspark.sampling import SamplingParams, make_generator
from dspark.scheduler import SPSTable, get_scheduler
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
def _cached_target(spec: str, dtype: torch.dtype) -> LoadedTarget:
    return load_target(spec, dtype)


def resolve(target: str | LoadedTarget, drafter: str | Drafter,
            dtype: str | torch.dtype = "auto") -> tuple[LoadedTarget, Drafter]:
    """A target spec is loaded in `dtype` (once; `resolve_dtype` names); a loaded target keeps its own."""
    loaded = _cached_target(target, resolve_dtype(dtype)) if isinstance(target, str) else target
    if isinstance(drafter, str):
        drafter = load_drafter(drafter, loaded.model)
    return loaded, drafter


def _validate(max_new_tokens: int, block_size: int | None) -> None:
    if max_new_tokens <= 0:
        raise DsparkError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if block_size is not None and block_size < 0:
        raise DsparkError(f"block_size must be >= 0, got {block_size}")


def effective_block_size(drafter: Drafter, requested: int | None, default: int = 7) -> int:
    """γ for this request: the drafter's own block size unless the caller asks for fewer.

    A DSpark drafter is trained for its block size; asking for more would draft slots it never learnt.
    """
    limit = drafter.max_block_size
    if requested is None:
        return default if limit is None else limit
    if limit is not None and requested > limit and limit > 0:
        raise DsparkError(f"block size {requested} exceeds the drafter's block size {limit}; it can only be reduced")
    return requested if limit is None else min(requested, limit)


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
    target: str | LoadedTarget = "default",
    drafter: str | Drafter = "default",
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
) -> TextStream:
    """Generate with speculative decoding, yielding text as it is committed.

    `scheduler` picks how many of each round's drafts are verified: "dspark" (default: paper
    Algorithm 1 on the drafter's calibrated confidences and the target's step rate, profiled once and
    cached), "fixed" (all), "fixed-<n>" or "threshold-<t>" (prefix with survival a_k >= t).
    Drafters without confidences (n-gram, EAGLE-3, MTP, draft LM) always verify every draft.
    `dtype` applies when `target` is a spec: "auto" (bf16 where the hardware runs it natively, else
    float32), "float32", "bfloat16", "float16" or a torch dtype.
    """
    sampling = SamplingParams(temperature, top_k, top_p)
    _validate(max_new_tokens, block_size)
    validate_prompt(prompt)
    get_scheduler(scheduler)
    loaded, drafter = resolve(target, drafter, dtype)
    block_size = effective_block_size(drafter, block_size)
    ids = prompt_ids(loaded, prompt, chat)
    handle = TextStream(iter(()))
    handle._deltas = _run(handle, loaded, drafter, ids, max_new_tokens, sampling, seed, stop or [], block_size,
                          scheduler)
    return handle


def scheduler_for(name: str, loaded: LoadedTarget, drafter: Drafter, block_size: int,
                  max_concurrency: int = 1) -> tuple[str, SPSTable | None]:
    """(scheduler, SPS table) to run `drafter` with. Drafters without confidences verify every draft
    unless a fixed γ is asked for; "dspark*" schedulers get the target's profiled step rates."""
    get_scheduler(name)
    has_confidence = getattr(getattr(drafter, "config", None), "enable_confidence_head", False)
    if block_size == 0 or (not has_confidence and not name.startswith("fixed") and name != "none"):
        return "fixed", None
    sps = None
    if name.startswith("dspark"):
        from dspark.profiling import sps_table

        sps = sps_table(loaded, max_concurrency * (block_size + 1))
    return name, sps


def single_request_target(loaded: LoadedTarget, drafter: Drafter) -> TargetBackend:
    """An engine backend with one slot: the ragged forward for Llama-family targets, else HF's."""
    return make_backend(loaded.model, drafter.target_layer_ids, max_slots=1)


def _run(handle: TextStream, loaded: LoadedTarget, drafter: Drafter, ids: torch.Tensor, max_new_tokens: int,
         sampling: SamplingParams, seed: int | None, stop: list[str], block_size: int,
         scheduler: str = "fixed") -> Iterator[str]:
    stats = GenerationStats()
    target = single_request_target(loaded, drafter)
    scheduler, sps = scheduler_for(scheduler, loaded, drafter, block_size)
    chunks = speculative_decode(
        target, drafter, ids, max_new_tokens=max_new_tokens, sampling=sampling,
        generator=make_generator(seed), block_size=block_size, eos_token_ids=eos_token_ids(loaded), stats=stats,
        scheduler=scheduler, sps=sps,
    )
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
    handle.result = GenerationResult(text.text, text.tokens, stats, finish, dtype_name(loaded.model.dtype))


def generate(prompt: str | Messages, **options) -> GenerationResult:
    """Generate a whole answer; options as for `stream`."""
    handle = stream(prompt, **options)
    for _ in handle:
        pass
    assert handle.result is not None
    return handle.result
