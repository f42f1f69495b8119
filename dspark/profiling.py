"""Target step-rate profiles SPS(B) for the scheduler, measured once per target and cached as JSON
next to the converted models (`$DSPARK_CACHE/profiles`)."""

import json
import math
import re
from pathlib import Path

import torch

from dspark.engine import make_backend
from dspark.loading import LoadedTarget, cache_dir, log, target_dtype_name
from dspark.ragged import Segment, auto_packed, supports_ragged
from dspark.scheduler import SPSTable, profile_sps

_TABLES: dict[Path, SPSTable] = {}


def profile_path(loaded: LoadedTarget, context_tokens: int) -> Path:
    model = loaded.model
    dtype = target_dtype_name(model)  # int4 apart
    if dtype == "bfloat16" and supports_ragged(model) and auto_packed(model):
        dtype += "-packed"  # the forward with oneDNN-packed weights has another cost curve than the plain one
    tag = f"{loaded.name}-{model.device.type}-{dtype}-t{torch.get_num_threads()}"
    return cache_dir() / "profiles" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', tag)}-ctx{context_tokens}.json"


def measure_sps(loaded: LoadedTarget, max_tokens: int, context_tokens: int = 256, repeats: int = 5,
                tokens_per_request: int = 8) -> SPSTable:
    """SPS(B) for B = 1..max_tokens new tokens, as the engine issues them: split over requests of up to
    `tokens_per_request` tokens (a round's anchor + drafts), each on a cache of `context_tokens`, all
    in one forward of the engine's backend (rolled back after each). B is measured densely up to 32
    and every 8 tokens beyond (interpolated in between)."""
    slots = math.ceil(max_tokens / tokens_per_request)
    backend = make_backend(loaded.model, max_slots=slots)
    vocab = min(int(loaded.model.get_output_embeddings().weight.shape[0]), 1000)
    generator = torch.Generator().manual_seed(0)
    for _ in range(slots):
        slot = backend.allocate()
        backend.forward([Segment(slot, torch.randint(0, vocab, (context_tokens,), generator=generator), "none")])
    tokens = torch.randint(0, vocab, (max_tokens,), generator=generator)

    def forward(num_tokens: int) -> None:
        segments = [Segment(slot, tokens[start : min(start + tokens_per_request, num_tokens)])
                    for slot, start in enumerate(range(0, num_tokens, tokens_per_request))]
        backend.forward(segments)
        for segment in segments:
            backend.rollback(segment.slot, context_tokens)

    sizes = sorted({*range(1, min(max_tokens, 32) + 1), *range(32, max_tokens + 1, 8), max_tokens})
    return profile_sps(forward, max_tokens, repeats=repeats, sizes=sizes)


def sps_table(loaded: LoadedTarget, max_tokens: int, context_tokens: int = 256, refresh: bool = False) -> SPSTable:
    """The cached profile when it covers `max_tokens`, else a fresh measurement (saved). Kept in memory
    too, so per-request schedulers do not re-read the file."""
    path = profile_path(loaded, context_tokens)
    remembered = _TABLES.get(path)
    if remembered is not None and remembered.max_tokens >= max_tokens and not refresh:
        return remembered
    if path.is_file() and not refresh:
        try:
            table = SPSTable.from_json(path.read_text())
            if table.max_tokens >= max_tokens:
                _TABLES[path] = table
                return table
        except (ValueError, KeyError, json.JSONDecodeError):
            pass
    log(f"profiling {loaded.name}'s step rate for 1..{max_tokens} tokens per forward (once; cached in {path})")
    table = measure_sps(loaded, max_tokens, context_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table.to_json())
    _TABLES[path] = table
    return table
