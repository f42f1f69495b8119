"""What a round costs, for the load-aware schedulers: the target's step rates SPS_R(B) per number of
requests R, and the drafter's seconds for n requests. Both are measured once and cached as JSON next to the
converted models (`$DSPARK_CACHE/profiles`), so a scheduler's decisions (and with them a seeded sampled
request's draws) do not change from one run to the next."""

import hashlib
import json
import math
import re
import statistics
import time
from pathlib import Path

import torch

from dspark.compiled import prefers_onednn_float32
from dspark.drafters.base import Drafter
from dspark.engine import Engine, Request, make_backend
from dspark.errors import DsparkError
from dspark.loading import LoadedTarget, cache_dir, log, target_dtype_name
from dspark.ragged import Segment, auto_packed, default_attention_dtype, supports_ragged
from dspark.sampling import SamplingParams, make_generator
from dspark.scheduler import RoundCost, SPSTable, time_interleaved

_COSTS: dict[Path, RoundCost] = {}
_DRAFTS: dict[Path, dict[int, float]] = {}


def _target_tag(loaded: LoadedTarget, compiled: bool = False) -> str:
    model = loaded.model
    dtype = target_dtype_name(model)  # int4 apart
    if dtype in ("bfloat16", "float32") and supports_ragged(model) and auto_packed(model):
        dtype += "-packed"  # the forward with oneDNN-packed weights has another cost curve than the plain one
    if supports_ragged(model) and default_attention_dtype(model.dtype, model.device) != model.dtype:
        dtype += "-attn32"  # likewise float32 attention over a half-precision target
    if compiled and supports_ragged(model):
        # `dspark.compiled`: steps cost ~2/3 of the eager ones on a CPU; "2" since rounds of several requests run
        # compiled too (session 26), so files measured with eager batched rounds are not read
        dtype += "-compiled2"
        if prefers_onednn_float32():
            dtype += "-onednn"  # every float32 product oneDNN's (`dspark.compiled.onednn_float32`, session 36)
    return f"{loaded.name}-{model.device.type}-{dtype}-t{torch.get_num_threads()}"


def _safe(tag: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", tag)


def profile_path(loaded: LoadedTarget, context_tokens: int, compiled: bool = False) -> Path:
    # "-v2": timed interleaved and fitted piecewise-linearly on a CPU since session 14 (v1 files could read flat)
    return cache_dir() / "profiles" / f"{_safe(_target_tag(loaded, compiled))}-ctx{context_tokens}-by-requests-v2.json"


def request_counts(max_requests: int) -> list[int]:
    """The R measured: powers of two below `max_requests`, and `max_requests` (interpolated between)."""
    return sorted({*(1 << i for i in range(max(max_requests, 1).bit_length()) if 1 << i < max_requests), max_requests})


def _spread(num_tokens: int, num_requests: int) -> list[int]:
    """B tokens over R requests as evenly as they go (every request verifies at least its anchor)."""
    base, extra = divmod(num_tokens, num_requests)
    return [base + (i < extra) for i in range(num_requests)]


def measure_verify(loaded: LoadedTarget, max_requests: int, tokens_per_request: int, context_tokens: int = 256,
                   repeats: int = 7, compiled: bool = False, layer_ids: tuple[int, ...] = ()) -> dict[int, SPSTable]:
    """SPS_R(B) for each R of `request_counts(max_requests)` and B = R..R·tokens_per_request, as the engine
    issues them: one forward of the engine's backend over R requests, each on a cache of `context_tokens`
    (rolled back after each). B is measured densely up to 32 and every 8 tokens beyond (interpolated between);
    B < R is not a round of R requests and reads as B = R. All cells are timed interleaved, median of `repeats`;
    on a CPU each curve is a piecewise-linear least-squares fit of its cells (`SPSTable.from_measurements`).
    `compiled`: through the compiled forward the engine will run (`dspark.compiled`), for the drafter's
    `layer_ids`, so the one compilation serves both."""
    backend = make_backend(loaded.model, layer_ids, max_slots=max_requests, compile=compiled)
    vocab = min(int(loaded.model.get_output_embeddings().weight.shape[0]), 1000)
    generator = torch.Generator().manual_seed(0)
    slots = [backend.allocate() for _ in range(max_requests)]
    for slot in slots:
        backend.forward([Segment(slot, torch.randint(0, vocab, (context_tokens,), generator=generator), "none")])
    tokens = torch.randint(0, vocab, (max_requests * tokens_per_request,), generator=generator)

    def forward(requests: int, num_tokens: int) -> None:
        counts = _spread(max(num_tokens, requests), requests)
        starts = [sum(counts[:i]) for i in range(requests)]
        segments = [Segment(slots[i], tokens[start : start + n])
                    for i, (start, n) in enumerate(zip(starts, counts, strict=True))]
        backend.forward(segments)
        for segment in segments:
            backend.rollback(segment.slot, context_tokens)

    sizes = {}
    for requests in request_counts(max_requests):
        largest = requests * tokens_per_request
        sizes[requests] = sorted({*range(requests, min(largest, 32) + 1), *range(32, largest + 1, 8), largest})
    # every (R, B) cell in one interleaved measurement: a slow spell cannot tilt one curve against another
    seconds = time_interleaved({(r, b): (lambda r=r, b=b: forward(r, b)) for r, bs in sizes.items() for b in bs},
                               repeats=repeats)
    # a CPU forward's time grows smoothly with B; a GPU's may step at tile sizes, which a line would smear
    method = "piecewise-linear" if loaded.model.device.type == "cpu" else "isotonic"
    tables = {r: SPSTable.from_measurements({b: 1.0 / max(seconds[r, b], 1e-9) for b in bs}, method)
              for r, bs in sizes.items()}
    for slot in slots:
        backend.release(slot)
    return tables


def _covers(cost: RoundCost, max_requests: int, tokens_per_request: int) -> bool:
    return all(r in cost.verify and cost.verify[r].max_tokens >= r * tokens_per_request
               for r in request_counts(max_requests))


def round_cost(loaded: LoadedTarget, max_requests: int, block_size: int, context_tokens: int = 256,
               refresh: bool = False, compiled: bool = False, layer_ids: tuple[int, ...] = ()) -> RoundCost:
    """The cached step rates when they cover rounds of up to `max_requests` requests of γ + 1 tokens, else a
    fresh measurement (saved). Kept in memory too, so per-request engines do not re-read the file. `compiled`:
    the rates of the compiled forward, cached apart (measured with `layer_ids`, the drafter's features)."""
    tokens_per_request = block_size + 1
    path = profile_path(loaded, context_tokens, compiled)
    remembered = _COSTS.get(path)
    if remembered is not None and _covers(remembered, max_requests, tokens_per_request) and not refresh:
        return remembered
    if path.is_file() and not refresh:
        try:
            cost = RoundCost.from_json(path.read_text())
            if _covers(cost, max_requests, tokens_per_request):
                _COSTS[path] = cost
                return cost
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            pass
    log(f"profiling {loaded.name}'s step rate for rounds of 1..{max_requests} requests of up to "
        f"{tokens_per_request} tokens (once; cached in {path})")
    cost = RoundCost(measure_verify(loaded, max_requests, tokens_per_request, context_tokens, compiled=compiled,
                                    layer_ids=layer_ids))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cost.to_json())
    _COSTS[path] = cost
    return cost


# ------------------------------------------------------------------------------------- drafting


def drafter_tag(drafter: Drafter) -> str:
    """What a drafter's cost depends on: its class and configuration (not its trained weights)."""
    config = getattr(drafter, "config", None)
    described = repr(config.to_dict() if hasattr(config, "to_dict") else config)
    compiled = "-compiled" if drafter.drafts_compiled else ""
    if compiled and prefers_onednn_float32():
        compiled += "-onednn"  # its float32 products packed for oneDNN (`dspark.compiled.onednn_float32`, session 36)
    return f"{type(drafter).__name__}-{hashlib.sha1(described.encode()).hexdigest()[:12]}{compiled}"


def draft_path(loaded: LoadedTarget, drafter: Drafter, block_size: int, context_tokens: int) -> Path:
    tag = f"draft-{_target_tag(loaded)}-{drafter_tag(drafter)}-g{block_size}-ctx{context_tokens}"
    return cache_dir() / "profiles" / f"{_safe(tag)}-v2.json"  # v2: a proposal includes its round's commit


def measure_draft(loaded: LoadedTarget, drafter: Drafter, max_requests: int, block_size: int,
                  context_tokens: int = 256, repeats: int = 5) -> dict[int, float]:
    """Seconds one batched proposal of `block_size` drafts takes for n requests, n in `request_counts`,
    on random prompts of `context_tokens` run through an engine of its own (freed after). Each timed
    proposal follows an untimed decoding round, so it also pays for projecting that round's committed
    features, as a drafting request does in serving (drafters project commits when they next draft)."""
    vocab = min(int(loaded.model.get_output_embeddings().weight.shape[0]), 1000)
    generator = torch.Generator().manual_seed(0)
    backend = make_backend(loaded.model, drafter.target_layer_ids, max_slots=max_requests)
    aside = Engine(backend, drafter, block_size=block_size, scheduler="none", max_concurrency=max_requests)
    # sampled, not greedy: greedy continuations of random prompts soon loop, and a drafter that looks the
    # context up first (`default+ngram`) would then time its free lookup instead of its model
    sampled = SamplingParams(temperature=1.0)
    requests = [aside.add(Request(torch.randint(0, vocab, (context_tokens,), generator=generator), 1 << 20,
                                  sampled, make_generator(i)))
                for i in range(max_requests)]
    while not all(r.prefilled or r.finished for r in requests):
        aside.step()
    failed = next((r.error for r in requests if r.finished), None)
    if failed is not None:
        raise DsparkError(f"could not profile the drafter: {failed}") from failed.cause
    seconds = {}
    for n in request_counts(max_requests):
        chosen = requests[:n]

        def propose(chosen: list[Request] = chosen) -> None:
            drafter.propose_batch([r.drafter_state for r in chosen], [r.context for r in chosen],
                                  [block_size] * len(chosen), [SamplingParams()] * len(chosen), [None] * len(chosen))

        propose()
        timings = []
        for _ in range(repeats):
            aside.step()
            start = time.perf_counter()
            propose()
            timings.append(time.perf_counter() - start)
        seconds[n] = statistics.median(timings)
    for request in requests:
        aside.abort(request)
    return seconds


def draft_cost(loaded: LoadedTarget, drafter: Drafter, max_requests: int, block_size: int,
               context_tokens: int = 256) -> dict[int, float]:
    """The drafter's cached seconds per proposal by number of requests, else measured (and saved)."""
    path = draft_path(loaded, drafter, block_size, context_tokens)
    remembered = _DRAFTS.get(path)
    if remembered is not None and max(remembered) >= max_requests:
        return remembered
    if path.is_file():
        try:
            seconds = {int(n): float(s) for n, s in json.loads(path.read_text())["draft_seconds"].items()}
            if seconds and max(seconds) >= max_requests and all(math.isfinite(s) and s >= 0 for s in seconds.values()):
                _DRAFTS[path] = seconds
                return seconds
        except (ValueError, KeyError, TypeError, AttributeError, json.JSONDecodeError):
            pass
    log(f"profiling the drafter's cost for 1..{max_requests} requests (once; cached in {path})")
    seconds = measure_draft(loaded, drafter, max_requests, block_size, context_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"draft_seconds": {str(n): s for n, s in seconds.items()}}))
    _DRAFTS[path] = seconds
    return seconds

