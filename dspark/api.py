"""Text-level entry points: `generate` and `stream`, with chat templates and stop strings."""

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

Messages = list[dict[str, str]]


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


def prompt_ids(loaded: LoadedTarget, prompt: str | Messages, chat: bool = True) -> torch.Tensor:
    """Token ids of the prompt, through the target's chat template unless `chat` is False."""
    _validate_prompt(prompt)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise DsparkError(f"target {loaded.name} has no tokenizer; pass token ids instead")
    if chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        ids = encoded["input_ids"]
    else:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        ids = tokenizer(text)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _validate_prompt(prompt: str | Messages) -> None:
    if isinstance(prompt, str) and not prompt.strip():
        raise DsparkError("prompt is empty")
    if isinstance(prompt, list) and not prompt:
        raise DsparkError("messages are empty")


def eos_token_ids(loaded: LoadedTarget) -> frozenset[int]:
    ids: set[int] = set()
    for source in (loaded.model.generation_config, loaded.model.config, loaded.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, list | tuple | set) else [eos])
    return frozenset(int(i) for i in ids)


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


def _stop_cut(text: str, stop: list[str]) -> int | None:
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None


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
    _validate_prompt(prompt)
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


class TextAccumulator:
    """Token ids in, text deltas out. Holds back the tail that could still grow into a stop string
    (or is an incomplete UTF-8 character) and cuts at the first stop string, keeping the tokens
    through it (as HF does)."""

    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop or [] if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        """The text that is now final; after a stop string, everything before it."""
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = _stop_cut(text, self.stop)
        if cut is not None:
            self.tokens = _tokens_through_stop(self.tokenizer, self.tokens, self.stop)
            self.text, self.stopped = text[:cut], True
            return self.flush()
        self.text = text
        ready = len(text) - self.holdback
        while ready > self.sent and text[ready - 1] == "\ufffd":
            ready -= 1
        if ready <= self.sent:
            return ""
        delta, self.sent = text[self.sent : ready], ready
        return delta

    def flush(self) -> str:
        """Whatever was held back (call once generation has ended)."""
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta


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


def _tokens_through_stop(tokenizer, tokens: list[int], stop: list[str]) -> list[int]:
    """The shortest prefix of `tokens` whose text contains a stop string (HF keeps that token)."""
    for n in range(1, len(tokens) + 1):
        if _stop_cut(tokenizer.decode(tokens[:n], skip_special_tokens=True), stop) is not None:
            return tokens[:n]
    return tokens


def generate(prompt: str | Messages, **options) -> GenerationResult:
    """Generate a whole answer; options as for `stream`."""
    handle = stream(prompt, **options)
    for _ in handle:
        pass
    assert handle.result is not None
    return handle.result
