"""Target step-rate profiles SPS(B) for the scheduler, measured once per target and cached as JSON
next to the converted models (`$DSPARK_CACHE/profiles`)."""

import json
import re
from pathlib import Path

import torch

from dspark.loading import LoadedTarget, cache_dir
from dspark.scheduler import SPSTable, profile_sps
from dspark.target import Target

_TABLES: dict[Path, SPSTable] = {}


def profile_path(loaded: LoadedTarget, context_tokens: int) -> Path:
    model = loaded.model
    tag = f"{loaded.name}-{model.device.type}-{str(model.dtype).split('.')[-1]}-t{torch.get_num_threads()}"
    return cache_dir() / "profiles" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', tag)}-ctx{context_tokens}.json"


def measure_sps(loaded: LoadedTarget, max_tokens: int, context_tokens: int = 256, repeats: int = 5) -> SPSTable:
    """SPS(B) for B = 1..max_tokens new tokens on a cache of `context_tokens` (rolled back after each)."""
    target = Target(loaded.model)
    vocab = min(target.vocab_size, 1000)
    generator = torch.Generator().manual_seed(0)
    target.prefill(torch.randint(0, vocab, (context_tokens,), generator=generator))
    tokens = torch.randint(0, vocab, (max_tokens,), generator=generator)

    def forward(num_tokens: int) -> None:
        target.extend(tokens[:num_tokens])
        target.rollback(context_tokens)

    return profile_sps(forward, max_tokens, repeats=repeats)


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
    table = measure_sps(loaded, max_tokens, context_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table.to_json())
    _TABLES[path] = table
    return table
