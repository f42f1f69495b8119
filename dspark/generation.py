"""Single-request speculative decoding on a backend: the engine at concurrency 1, with γ as given.

This is the low-level path (custom targets, tests); entry points that start from a loaded target build
their engine with `dspark.factory.build_engine`. With `NoDrafter` every round verifies nothing and
emits one target token, which is exactly vanilla decoding — so vanilla and speculative generation share
one loop too.
"""

from collections.abc import Iterator

import torch

from dspark.drafters.base import Drafter
from dspark.engine import Engine, Request, TargetBackend
from dspark.sampling import SamplingParams
from dspark.scheduler import Scheduler, StepCurve
from dspark.stats import GenerationStats
from dspark.target import SerialBackend, Target

__all__ = ["GenerationStats", "speculative_decode"]


def speculative_decode(
    backend: TargetBackend | Target,
    drafter: Drafter,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    block_size: int,
    eos_token_ids: frozenset[int] = frozenset(),
    stats: GenerationStats | None = None,
    scheduler: str | Scheduler = "fixed",
    sps: StepCurve | None = None,
) -> Iterator[list[int]]:
    """Yield the newly committed tokens of each round (the first chunk comes from the prefill).

    `backend` is an engine backend (`RaggedBackend`, `SerialBackend`) or one batch-1 `Target` (or any
    object with its `extend` / `rollback` / `length`). Stops after an EOS token (which is yielded, as
    HF `generate` returns it) or `max_new_tokens`.
    """
    if not hasattr(backend, "allocate"):
        backend = SerialBackend([backend])
    engine = Engine(backend, drafter, block_size=block_size, scheduler=scheduler, sps=sps, max_concurrency=1)
    request = Request(prompt_ids, max_new_tokens, sampling, generator, eos_token_ids,
                      stats=stats if stats is not None else GenerationStats())
    yield from engine.stream(request)
