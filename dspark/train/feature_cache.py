"""Offline target-feature cache: one target pass over the corpus, then training never runs the target.

On two CPU cores the frozen target's forward and a full-vocabulary teacher softmax were two thirds of
an online training step. Since the target never changes, its outputs are computed once per corpus
token and stored as memory-mapped shards (the same trade DeepSpec, SpecForge and EAGLE make at GPU
scale):

- `hidden` (N, len(layers) * D): the hidden states of the cached target layers (DeepSpec ids: L =
  output of layer L, the last layer after the final norm, -1 = embeddings), bf16 stored as uint16 bits;
- `topk_ids` (N, k) and `topk_logits` (N, k) float32: the teacher's k most likely next tokens at every
  position, with `logsumexp` (N,) float32 of the full logits, so p on the top-k and the tail mass
  1 - Σ p_top are exact;
- `offsets` (S + 1,) int64: sample boundaries (samples are cut to `max_len` tokens).

A manifest keys the cache by (target, target fingerprint, layers, dtype, top-k, max_len, corpus
checksum) and lists every finished shard with its files' sizes and blake2b digests, and a digest of the
token ids it was computed from. That digest lets a grown corpus (new samples appended, the old ones
unchanged) keep the shards of its earlier version (`grow=True`): the target pass is the costly stage. The pass is
resumable: a shard is written to a temporary directory, renamed when complete, then recorded in the
manifest; a restart skips recorded shards. A cache whose key differs from what the trainer asks for
(stale), or whose files are missing, truncated or altered (corrupt), is refused with a clear error.
"""

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from dspark.errors import DsparkError
from dspark.target import hf_hidden_index

FORMAT = "dspark-feature-cache/1"
MANIFEST = "manifest.json"
FILES = ("hidden", "topk_ids", "topk_logits", "logsumexp", "offsets")
DEFAULT_TOP_K = 32
DEFAULT_SHARD_TOKENS = 131072
LOGIT_ROWS = 1024  # rows of the LM head at a time: bounds the (rows, V) float32 logits


class FeatureCacheError(DsparkError):
    """The feature cache is missing, stale (built for another target/layers/corpus) or corrupt."""


@dataclass(frozen=True)
class CacheKey:
    """What a cache was built from; any difference makes it stale."""

    target: str
    target_fingerprint: str
    layers: tuple[int, ...]
    dtype: str
    top_k: int
    max_len: int
    corpus_checksum: str

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "layers": list(self.layers)}


def model_fingerprint(model: PreTrainedModel) -> str:
    """A short digest of the target's config and a sample of its weights (rounded to bf16, so a float32
    and a bfloat16 load agree): two different models with the same name (say, another quantisation)
    must not share a cache."""
    digest = hashlib.blake2b(digest_size=12)
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("dtype", "torch_dtype")}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    state = sorted(model.state_dict().items())
    for name, tensor in state[:: max(1, len(state) // 16)]:
        flat = tensor.detach().to(torch.bfloat16).float().flatten()  # the same in fp32 and bf16 loads
        digest.update(name.encode())
        digest.update(flat[:: max(1, flat.numel() // 4096)].numpy().tobytes())
    return digest.hexdigest()


def sample_bounds(offsets: np.ndarray, max_len: int) -> np.ndarray:
    """Cache offsets (S + 1,) of the corpus samples cut to `max_len` tokens each."""
    lengths = np.minimum(np.diff(offsets), max_len)
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def plan_shards(bounds: np.ndarray, shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive sample ranges [first, last) of about `shard_tokens` tokens (at least one sample)."""
    shards, first = [], 0
    num_samples = len(bounds) - 1
    while first < num_samples:
        last = int(np.searchsorted(bounds, bounds[first] + shard_tokens, side="right")) - 1
        last = max(last, first + 1)
        shards.append((first, min(last, num_samples)))
        first = shards[-1][1]
    return shards


# ---------------------------------------------------------------- the target pass


@torch.inference_mode()
def target_outputs(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, layers: Sequence[int],
                   top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For right-padded ids/mask (B, T): hidden (B, T, len(layers)·D) in the model's dtype, top-k ids
    (B, T, k), their logits (B, T, k) float32 and the full logsumexp (B, T) float32."""
    decoder = model.get_decoder()
    out = decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    hidden = torch.cat([out.hidden_states[hf_hidden_index(i)] for i in layers], -1)
    final = out.last_hidden_state.flatten(0, 1)
    weight = model.get_output_embeddings().weight
    top_ids, top_logits, lse = [], [], []
    for start in range(0, final.shape[0], LOGIT_ROWS):
        logits = (final[start : start + LOGIT_ROWS] @ weight.T).float()
        values, indices = logits.topk(top_k, dim=-1)
        top_ids.append(indices)
        top_logits.append(values)
        shift = values[:, :1]
        lse.append(shift.squeeze(-1) + (logits - shift).exp().sum(-1).log())
    shape = ids.shape
    return (hidden, torch.cat(top_ids).view(*shape, top_k), torch.cat(top_logits).view(*shape, top_k),
            torch.cat(lse).view(shape))


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: 16-bit floats are stored as their raw bits."""
    if tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.contiguous().view(torch.uint16).numpy()
    return tensor.contiguous().numpy()


def _write_shard(directory: Path, model: PreTrainedModel, tokens: np.ndarray, corpus_offsets: np.ndarray,
                 bounds: np.ndarray, first: int, last: int, key: CacheKey, batch_tokens: int, pad_id: int) -> None:
    """Run the target over samples [first, last) and write their arrays into `directory`."""
    base = int(bounds[first])
    count = int(bounds[last] - base)
    width = len(key.layers) * int(model.config.get_text_config().hidden_size)
    id_dtype = np.uint16 if model.config.get_text_config().vocab_size <= 65536 else np.int32
    directory.mkdir(parents=True)
    arrays = {
        "hidden": np.lib.format.open_memmap(directory / "hidden.npy", "w+", np.uint16, (count, width)),
        "topk_ids": np.lib.format.open_memmap(directory / "topk_ids.npy", "w+", id_dtype, (count, key.top_k)),
        "topk_logits": np.lib.format.open_memmap(directory / "topk_logits.npy", "w+", np.float32,
                                                 (count, key.top_k)),
        "logsumexp": np.lib.format.open_memmap(directory / "logsumexp.npy", "w+", np.float32, (count,)),
    }
    np.save(directory / "offsets.npy", bounds[first : last + 1] - base)
    order = sorted(range(first, last), key=lambda i: int(bounds[i + 1] - bounds[i]))  # little padding
    batch: list[int] = []
    for position, sample in enumerate(order):
        batch.append(sample)
        longest = int(bounds[batch[-1] + 1] - bounds[batch[-1]])
        if position + 1 < len(order) and longest * (len(batch) + 1) <= batch_tokens:
            continue
        lengths = [int(bounds[i + 1] - bounds[i]) for i in batch]
        ids = torch.full((len(batch), max(lengths)), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (i, n) in enumerate(zip(batch, lengths, strict=True)):
            ids[row, :n] = torch.from_numpy(tokens[corpus_offsets[i] : corpus_offsets[i] + n].astype(np.int64))
            mask[row, :n] = 1
        hidden, top_ids, top_logits, lse = target_outputs(model, ids, mask, key.layers, key.top_k)
        for row, (i, n) in enumerate(zip(batch, lengths, strict=True)):
            a = int(bounds[i]) - base
            arrays["hidden"][a : a + n] = _bits(hidden[row, :n].to(torch.bfloat16))
            arrays["topk_ids"][a : a + n] = top_ids[row, :n].numpy().astype(id_dtype)
            arrays["topk_logits"][a : a + n] = top_logits[row, :n].numpy()
            arrays["logsumexp"][a : a + n] = lse[row, :n].numpy()
        batch = []
    for array in arrays.values():
        array.flush()
    del arrays


def shard_token_digest(tokens: np.ndarray, offsets: np.ndarray, bounds: np.ndarray, first: int, last: int) -> str:
    """blake2b of the (cut) token ids of samples [first, last): equal exactly when the shard's inputs are."""
    digest = hashlib.blake2b(digest_size=16)
    for i in range(first, last):
        n = int(bounds[i + 1] - bounds[i])
        digest.update(np.int64(n).tobytes())
        digest.update(tokens[offsets[i] : offsets[i] + n].astype(np.int64).tobytes())
    return digest.hexdigest()


def _digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _read_manifest(cache_dir: Path) -> dict | None:
    path = cache_dir / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FeatureCacheError(f"{path}: not a feature-cache manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FeatureCacheError(f"{path}: not a {FORMAT} manifest")
    return manifest


def _write_manifest(cache_dir: Path, manifest: dict) -> None:
    tmp = cache_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    with tmp.open("rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, cache_dir / MANIFEST)


def stale_fields(manifest: dict, key: CacheKey) -> list[str]:
    """Names of the key fields in which a manifest differs from `key`."""
    saved = manifest.get("key", {})
    return [name for name, value in key.to_dict().items() if saved.get(name) != value]


# duplicates: the same shape as regenerate.RegenerateStats (counters + a tokens/s property), other fields:
# kept apart on purpose, each job reports its own
@dataclass
class BuildStats:
    shards_before: int = 0
    shards_written: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def build_cache(cache_dir: str | Path, model: PreTrainedModel, tokens: np.ndarray, offsets: np.ndarray,
                key: CacheKey, *, shard_tokens: int = DEFAULT_SHARD_TOKENS, batch_tokens: int = 4096,
                pad_id: int = 0, max_shards: int | None = None, progress: bool = True,
                grow: bool = False) -> BuildStats:
    """Write (or finish) the cache of corpus `tokens` / `offsets` under `cache_dir`. Resumes a partial
    cache with the same key; refuses one with another key, except that with `grow` a cache of another
    version of the corpus (same everything else) keeps the shards whose token ids are unchanged.
    `max_shards` bounds this run's work."""
    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(cache_dir)
    bounds = sample_bounds(offsets, key.max_len)
    plan = plan_shards(bounds, shard_tokens)
    if manifest is not None and (changed := stale_fields(manifest, key)):
        if not (grow and changed == ["corpus_checksum"]):
            hint = " (or --grow, if only the corpus grew)" if changed == ["corpus_checksum"] else ""
            raise FeatureCacheError(f"{cache_dir} holds a cache built with other {', '.join(changed)}; "
                                    f"use another directory or delete it{hint}")
        manifest = regrown_manifest(cache_dir, manifest, key, plan, tokens, offsets, bounds)
    if manifest is None:
        manifest = {"format": FORMAT, "key": key.to_dict(), "num_samples": len(bounds) - 1,
                    "num_tokens": int(bounds[-1]), "hidden_size": int(model.config.get_text_config().hidden_size),
                    "shards": {}}
    stats = BuildStats(shards_before=len(manifest["shards"]))
    for leftover in cache_dir.glob("*.tmp"):
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    todo = [(i, span) for i, span in enumerate(plan) if f"{i:05d}" not in manifest["shards"]][:max_shards]
    started = time.perf_counter()
    model.eval()
    for number, (index, (first, last)) in enumerate(todo, 1):
        name = f"{index:05d}"
        tmp = cache_dir / f"shard_{name}.tmp"
        _write_shard(tmp, model, tokens, offsets, bounds, first, last, key, batch_tokens, pad_id)
        files = {f: {"bytes": (tmp / f"{f}.npy").stat().st_size, "blake2b": _digest(tmp / f"{f}.npy")}
                 for f in FILES}
        final = cache_dir / f"shard_{name}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        manifest["shards"][name] = {"samples": [first, last], "tokens": int(bounds[last] - bounds[first]),
                                    "token_digest": shard_token_digest(tokens, offsets, bounds, first, last),
                                    "files": files}
        _write_manifest(cache_dir, manifest)
        stats.shards_written += 1
        stats.tokens += int(bounds[last] - bounds[first])
        stats.seconds = time.perf_counter() - started
        if progress:
            print(f"[dspark] feature cache: shard {index + 1}/{len(plan)} ({number}/{len(todo)} this run), "
                  f"{stats.tokens_per_s:.0f} tokens/s", file=sys.stderr, flush=True)
    manifest["complete"] = len(manifest["shards"]) == len(plan)
    _write_manifest(cache_dir, manifest)
    return stats


def regrown_manifest(cache_dir: Path, manifest: dict, key: CacheKey, plan: list[tuple[int, int]], tokens: np.ndarray,
                     offsets: np.ndarray, bounds: np.ndarray) -> dict:
    """The manifest of `cache_dir` re-keyed to a new version of its corpus: a shard is kept when it covers
    the same samples as the new plan's shard of that number and its token ids are unchanged (a shard
    without a token digest, from before digests were recorded, is rebuilt); the others are deleted."""
    kept = {}
    for name, shard in manifest["shards"].items():
        index, span = int(name), tuple(shard["samples"])
        same = (index < len(plan) and plan[index] == span and shard.get("token_digest")
                == shard_token_digest(tokens, offsets, bounds, *span))
        if same:
            kept[name] = shard
        else:
            shutil.rmtree(cache_dir / f"shard_{name}", ignore_errors=True)
    print(f"[dspark] feature cache: the corpus grew; {len(kept)} of {len(manifest['shards'])} shards kept",
          file=sys.stderr, flush=True)
    grown = {**manifest, "key": key.to_dict(), "num_samples": len(bounds) - 1, "num_tokens": int(bounds[-1]),
             "shards": kept, "complete": False}
    _write_manifest(cache_dir, grown)
    return grown


# ---------------------------------------------------------------- reading


@dataclass
class CachedSample:
    """One sample's cached target outputs, as torch tensors (copies, safe to modify)."""

    hidden: torch.Tensor  # (T, F) bfloat16
    topk_ids: torch.Tensor  # (T, k) int64
    topk_logits: torch.Tensor  # (T, k) float32
    logsumexp: torch.Tensor  # (T,) float32


class FeatureCache:
    """A finished cache, memory-mapped. `open` checks the key and every file (size always, digest when
    `verify`); `sample(i)` reads one corpus sample."""

    def __init__(self, cache_dir: Path, manifest: dict, arrays: list[dict[str, np.ndarray]],
                 shard_of: np.ndarray, firsts: np.ndarray) -> None:
        self.cache_dir = cache_dir
        self.manifest = manifest
        self.key = manifest["key"]
        self.layers = tuple(self.key["layers"])
        self.hidden_size = int(manifest["hidden_size"])
        self._arrays = arrays
        self._shard_of = shard_of
        self._firsts = firsts

    @property
    def num_samples(self) -> int:
        return int(self.manifest["num_samples"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    def bytes_on_disk(self) -> int:
        return sum(f["bytes"] for shard in self.manifest["shards"].values() for f in shard["files"].values())

    def length(self, index: int) -> int:
        shard = self._arrays[self._shard_of[index]]
        local = index - self._firsts[self._shard_of[index]]
        return int(shard["offsets"][local + 1] - shard["offsets"][local])

    def sample(self, index: int, layers: Sequence[int] | None = None) -> CachedSample:
        """Sample `index`, with the hidden states of `layers` (default: every cached layer) side by side."""
        shard = self._arrays[self._shard_of[index]]
        local = index - self._firsts[self._shard_of[index]]
        a, b = int(shard["offsets"][local]), int(shard["offsets"][local + 1])
        hidden = torch.from_numpy(np.array(shard["hidden"][a:b])).view(torch.bfloat16)
        if layers is not None and tuple(layers) != self.layers:
            hidden = hidden.view(b - a, len(self.layers), self.hidden_size)[:, self.columns(layers)].flatten(1)
        return CachedSample(hidden, torch.from_numpy(np.array(shard["topk_ids"][a:b]).astype(np.int64)),
                            torch.from_numpy(np.array(shard["topk_logits"][a:b])),
                            torch.from_numpy(np.array(shard["logsumexp"][a:b])))

    def samples(self, indices: Sequence[int], layers: Sequence[int] | None = None) -> list[CachedSample]:
        """`sample` of each index (the batched read `make_cached_batch` uses)."""
        return [self.sample(index, layers) for index in indices]

    def columns(self, layers: Sequence[int]) -> list[int]:
        missing = [i for i in layers if i not in self.layers]
        if missing:
            raise FeatureCacheError(f"{self.cache_dir} caches target layers {list(self.layers)}, not {missing}: "
                                    "rebuild it with those layers")
        return [self.layers.index(i) for i in layers]

    @classmethod
    def open(cls, cache_dir: str | Path, key: CacheKey | None = None, *, verify: bool = True) -> "FeatureCache":
        """Open a complete cache; with `key`, refuse it when any field but `layers` differs (a drafter may
        read a subset of the cached layers)."""
        cache_dir = Path(cache_dir).expanduser()
        manifest = _read_manifest(cache_dir)
        if manifest is None:
            raise FeatureCacheError(f"no feature cache at {cache_dir} (build it with `dspark data features`)")
        if not manifest.get("complete"):
            raise FeatureCacheError(f"{cache_dir}: the feature cache is incomplete "
                                    f"({len(manifest['shards'])} shards); rerun `dspark data features` to finish it")
        if key is not None:
            changed = [f for f in stale_fields(manifest, key) if f != "layers"]
            if changed:
                raise FeatureCacheError(f"{cache_dir} is stale: built with other {', '.join(changed)} "
                                        f"(cache {({f: manifest['key'].get(f) for f in changed})}); rebuild it")
        arrays, shard_of, firsts = [], np.zeros(manifest["num_samples"], dtype=np.int32), []
        for number, (name, shard) in enumerate(sorted(manifest["shards"].items())):
            loaded = {}
            for file, info in shard["files"].items():
                path = cache_dir / f"shard_{name}" / f"{file}.npy"
                if not path.exists():
                    raise FeatureCacheError(f"{path} is missing: the feature cache is corrupt; rebuild it")
                if path.stat().st_size != info["bytes"]:
                    raise FeatureCacheError(f"{path} has {path.stat().st_size} bytes, expected {info['bytes']}: "
                                            "truncated or corrupt; rebuild the cache")
                if verify and _digest(path) != info["blake2b"]:
                    raise FeatureCacheError(f"{path}: checksum mismatch, the feature cache is corrupt; rebuild it")
                try:
                    loaded[file] = np.load(path, mmap_mode="r")
                except ValueError as error:
                    raise FeatureCacheError(f"{path}: unreadable ({error}); rebuild the cache") from None
            first, last = shard["samples"]
            shard_of[first:last] = number
            firsts.append(first)
            arrays.append(loaded)
        return cls(cache_dir, manifest, arrays, shard_of, np.array(firsts))
