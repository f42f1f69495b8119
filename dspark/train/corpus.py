"""A compact, lasting corpus of self-distilled training data: token ids in one safetensors file.

Regenerating answers with the target takes hours on a CPU, and the JSONL it writes repeats every
answer as text and as token ids. The corpus keeps only what training needs (the exact prompt and
answer token ids the target saw and sampled) in one small file (format "dspark-corpus/1", see
docs/corpus.md) that can be committed to git, so that no machine has to regenerate it, and that any
tool can read with safetensors + numpy alone. A sha256 over the data makes silent corruption (a bad
merge, an edit, a truncated download) an error rather than a drafter trained on garbage.
"""

import datetime
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dspark.loading import DEFAULT_GGUF, DEFAULT_PACKAGE
from dspark.train.data import DataError

FORMAT = "dspark-corpus/1"
# The default target (SmolLM2-135M-Instruct) without loading it: its vocabulary size and where its
# weights come from, so that `dspark data pack` needs no model.
DEFAULT_VOCAB_SIZE = 49152
DEFAULT_REVISION = f"{DEFAULT_PACKAGE}:{Path(DEFAULT_GGUF).name}"
# The order of the tensors in the checksum (and their dtypes, tokens aside).
TENSORS = ("tokens", "offsets", "prompt_lengths", "finished", "source_index")
DTYPES = {"offsets": np.int64, "prompt_lengths": np.int32, "finished": np.uint8, "source_index": np.uint8}
MAX_SOURCES = 256  # source_index is uint8


class CorpusError(DataError):
    """A corpus file is missing, malformed or corrupt, or corpora cannot be combined."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the file for vocabularies that fit (most small targets); uint32 otherwise."""
    return np.dtype(np.uint16 if vocab_size < 65536 else np.uint32)


def _ids_json(ids: Sequence[str]) -> str:
    """The canonical ids JSON (compact, UTF-8): the checksum covers these exact bytes."""
    return json.dumps(list(ids), ensure_ascii=False, separators=(",", ":"))


def _little_endian(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))


def compute_checksum(arrays: Mapping[str, np.ndarray], ids_json: str) -> str:
    """sha256 over the tensors' bytes (little-endian, C order, in TENSORS order) then the ids JSON: ids
    are covered because a shifted id list would silently pair samples with the wrong names."""
    digest = hashlib.sha256()
    for name in TENSORS:
        digest.update(memoryview(_little_endian(arrays[name])).cast("B"))
    digest.update(ids_json.encode("utf-8"))
    return digest.hexdigest()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()


@dataclass
class Corpus:
    """Samples back to back: sample i is `tokens[offsets[i]:offsets[i + 1]]`, its first
    `prompt_lengths[i]` tokens the prompt (chat template included), the rest the target's answer
    (ending with EOS when `finished[i]`). `meta` holds target, target_revision, vocab_size, sampling
    (a dict or None) and created."""

    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lengths: np.ndarray
    finished: np.ndarray
    source_index: np.ndarray
    ids: list[str]
    sources: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_answer_tokens(self) -> int:
        return self.num_tokens - int(self.prompt_lengths.sum(dtype=np.int64))

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def checksum(self) -> str:
        return compute_checksum(self.arrays(), _ids_json(self.ids))

    def arrays(self) -> dict[str, np.ndarray]:
        """The tensors as stored: every array in its format dtype."""
        arrays = {name: np.asarray(getattr(self, name)) for name in TENSORS}
        arrays["tokens"] = arrays["tokens"].astype(token_dtype(self.vocab_size), copy=False)
        for name, dtype in DTYPES.items():
            arrays[name] = arrays[name].astype(dtype, copy=False)
        return arrays

    def prompt_ids(self, i: int) -> np.ndarray:
        start = int(self.offsets[i])
        return self.tokens[start : start + int(self.prompt_lengths[i])]

    def answer_ids(self, i: int) -> np.ndarray:
        return self.tokens[int(self.offsets[i]) + int(self.prompt_lengths[i]) : int(self.offsets[i + 1])]

    def sample(self, i: int) -> dict[str, Any]:
        """Sample i with the same keys as a regenerate JSONL line (ids as numpy arrays)."""
        return {
            "id": self.ids[i],
            "source": self.sources[int(self.source_index[i])],
            "finished": bool(self.finished[i]),
            "prompt_ids": self.prompt_ids(i),
            "answer_ids": self.answer_ids(i),
        }

    def select(self, indices: Sequence[int] | np.ndarray) -> "Corpus":
        """The samples at `indices` (or a boolean mask), in that order, as a new corpus (a train/held-out
        split, a shuffle). One gather over the token array, no per-sample Python loop."""
        index = np.asarray(indices)
        if index.dtype == bool:
            index = np.flatnonzero(index)
        index = index.astype(np.int64, copy=False).reshape(-1)
        if len(np.unique(index)) != len(index):
            raise CorpusError("select: repeated indices would duplicate sample ids")
        starts = self.offsets[index]
        lengths = self.offsets[index + 1] - starts
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return replace(
            self,
            tokens=self.tokens[positions],
            offsets=offsets,
            prompt_lengths=self.prompt_lengths[index],
            finished=self.finished[index],
            source_index=self.source_index[index],
            ids=[self.ids[i] for i in index.tolist()],
            sources=list(self.sources),
            meta=dict(self.meta),
        )

    def summary(self) -> dict[str, Any]:
        counts = np.bincount(self.source_index, minlength=len(self.sources))
        arrays = self.arrays()
        return {
            "format": FORMAT,
            "target": self.meta.get("target"),
            "target_revision": self.meta.get("target_revision"),
            "vocab_size": self.vocab_size,
            "samples": self.num_samples,
            "answer_tokens": self.num_answer_tokens,
            "prompt_tokens": self.num_tokens - self.num_answer_tokens,
            "finished_fraction": round(float(self.finished.mean()), 4) if self.num_samples else 0.0,
            "sources": {name: int(count) for name, count in zip(self.sources, counts, strict=True)},
            "checksum": compute_checksum(arrays, _ids_json(self.ids)),
            "bytes": sum(array.nbytes for array in arrays.values()),
        }


def _check(corpus: Corpus, where: str) -> None:
    """Every invariant a reader relies on, so that a bad file is refused on load, not deep in training."""

    def fail(message: str) -> None:
        raise CorpusError(f"{where}: {message}")

    for name in TENSORS:
        if np.asarray(getattr(corpus, name)).ndim != 1:
            fail(f"tensor {name!r} is not one-dimensional")
    tokens, offsets = corpus.tokens, corpus.offsets
    count = len(offsets) - 1
    if count < 0 or offsets[0] != 0 or offsets[-1] != len(tokens):
        fail(f"offsets must start at 0 and end at the number of tokens ({len(tokens)})")
    lengths = np.diff(offsets)
    if (lengths < 0).any():
        fail("offsets are not monotone")
    for name in ("prompt_lengths", "finished", "source_index"):
        if len(getattr(corpus, name)) != count:
            fail(f"tensor {name!r} has {len(getattr(corpus, name))} entries for {count} samples")
    if len(corpus.ids) != count:
        fail(f"{len(corpus.ids)} ids for {count} samples")
    if len(set(corpus.ids)) != count:
        fail("duplicate sample ids")
    if ((corpus.prompt_lengths < 0) | (corpus.prompt_lengths > lengths)).any():
        fail("a prompt length exceeds its sample's length")
    if (corpus.finished > 1).any():
        fail("finished must be 0 or 1")
    if count and int(corpus.source_index.max()) >= len(corpus.sources):
        fail(f"source_index out of range ({len(corpus.sources)} sources)")
    if len(corpus.sources) > MAX_SOURCES:
        fail(f"more than {MAX_SOURCES} sources")
    vocab_size = corpus.meta.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        fail(f"bad vocab_size {vocab_size!r}")
    if len(tokens) and int(tokens.max()) >= vocab_size:
        fail(f"token id {int(tokens.max())} is outside the vocabulary (vocab_size {vocab_size})")


def save_corpus(path: str | Path, corpus: Corpus) -> None:
    """Write atomically (temp file in the same directory, fsync, rename): a kill never leaves a
    half-written corpus in place of a good one."""
    path = Path(path)
    _check(corpus, str(path))
    arrays = {name: _little_endian(array) for name, array in corpus.arrays().items()}
    ids_json = _ids_json(corpus.ids)
    metadata = {
        "format": FORMAT,
        "target": str(corpus.meta.get("target", "")),
        "target_revision": str(corpus.meta.get("target_revision", "")),
        "vocab_size": str(corpus.vocab_size),
        "sampling": json.dumps(corpus.meta.get("sampling"), sort_keys=True),
        "sources": json.dumps(corpus.sources, ensure_ascii=False),
        "ids": ids_json,
        "created": str(corpus.meta.get("created") or _now()),
        "sha256": compute_checksum(arrays, ids_json),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644  # mkstemp's 0600 would hide it from others
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(arrays, temp, metadata=metadata)
        os.chmod(temp, mode)
        with open(temp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def load_corpus(path: str | Path) -> Corpus:
    """Read and verify a corpus file; anything wrong is a one-line CorpusError naming the file."""
    where = str(path)
    if not Path(path).is_file():
        raise CorpusError(f"corpus file not found: {where}")
    try:
        with safe_open(where, framework="np") as handle:
            metadata = handle.metadata() or {}
            names = set(handle.keys())
            if metadata.get("format") != FORMAT:
                raise CorpusError(f"{where}: not a {FORMAT} file (format tag {metadata.get('format')!r})")
            missing = [name for name in TENSORS if name not in names]
            if missing:
                raise CorpusError(f"{where}: missing tensors {', '.join(missing)}")
            arrays = {name: handle.get_tensor(name) for name in TENSORS}
    except (SafetensorError, OSError, ValueError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CorpusError(f"{where}: not a readable safetensors file (truncated or corrupt?): {message}") from None
    try:
        ids_json = metadata["ids"]
        ids, sources = json.loads(ids_json), json.loads(metadata["sources"])
        meta = {
            "target": metadata["target"],
            "target_revision": metadata["target_revision"],
            "vocab_size": int(metadata["vocab_size"]),
            "sampling": json.loads(metadata["sampling"]),
            "created": metadata["created"],
        }
        expected = metadata["sha256"]
    except KeyError as error:
        raise CorpusError(f"{where}: metadata field {error.args[0]!r} is missing") from None
    except ValueError as error:
        raise CorpusError(f"{where}: malformed metadata: {error}") from None
    if not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        raise CorpusError(f"{where}: metadata 'ids' is not a list of strings")
    if not (isinstance(sources, list) and all(isinstance(s, str) for s in sources)):
        raise CorpusError(f"{where}: metadata 'sources' is not a list of strings")
    wanted = token_dtype(meta["vocab_size"])
    if arrays["tokens"].dtype != wanted:
        raise CorpusError(
            f"{where}: tokens are {arrays['tokens'].dtype}, expected {wanted} for vocab_size {meta['vocab_size']}"
        )
    for name, dtype in DTYPES.items():
        if arrays[name].dtype != dtype:
            raise CorpusError(f"{where}: tensor {name!r} is {arrays[name].dtype}, expected {np.dtype(dtype)}")
    # The checksum first: a corrupt file is reported as such, not by whichever invariant the damage broke.
    actual = compute_checksum(arrays, ids_json)
    if actual != expected:
        raise CorpusError(
            f"{where}: checksum mismatch: the file is corrupt or was edited; expected {expected}, got {actual}"
        )
    corpus = Corpus(**arrays, ids=ids, sources=sources, meta=meta)
    _check(corpus, where)
    return corpus


def _sampling_dict(sampling: Any) -> dict[str, Any] | None:
    if sampling is None:
        return None
    if is_dataclass(sampling) and not isinstance(sampling, type):
        sampling = asdict(sampling)
    return {key: sampling[key] for key in ("temperature", "top_p", "max_new_tokens") if key in sampling}


def _complete_lines(path: Path) -> Iterable[tuple[int, bytes]]:
    """Numbered lines that end with a newline. The last one may be half-written by a running (or
    killed) `regenerate`; it is left out here and left alone on disk (regenerate cuts it itself)."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise CorpusError(f"cannot read {path}: {error.strerror or error}") from None
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        print(f"[dspark] {path}: ignoring a half-written last line ({len(data) - complete} bytes)", file=sys.stderr)
    return enumerate(data[:complete].splitlines(), 1)


def corpus_from_jsonl(
    paths: Sequence[str | Path],
    *,
    target: str,
    target_revision: str,
    vocab_size: int,
    sampling: Any = None,
) -> Corpus:
    """A corpus from `dspark data regenerate` JSONL files, in file order. The first line of an id wins
    (a later one is a rerun); answers of fewer than 2 tokens are skipped (nothing to draft after the
    anchor). `sampling` (a dict or SamplingConfig) records how answers were sampled."""
    tokens: list[int] = []
    lengths: list[int] = []
    prompt_lengths: list[int] = []
    finished: list[bool] = []
    source_index: list[int] = []
    ids: list[str] = []
    sources: dict[str, int] = {}
    seen: set[str] = set()
    for path in map(Path, paths):
        if not path.is_file():
            raise CorpusError(f"regenerated JSONL not found: {path}")
        for lineno, line in _complete_lines(path):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                sample_id, source = str(record["id"]), str(record["source"])
                prompt, answer, done = record["prompt_ids"], record["answer_ids"], bool(record["finished"])
                if not (isinstance(prompt, list) and isinstance(answer, list)):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise CorpusError(f"{path}:{lineno}: not a regenerated sample with prompt_ids and answer_ids") from None
            if sample_id in seen or len(answer) < 2:
                continue
            seen.add(sample_id)
            ids.append(sample_id)
            source_index.append(sources.setdefault(source, len(sources)))
            tokens.extend(prompt)
            tokens.extend(answer)
            lengths.append(len(prompt) + len(answer))
            prompt_lengths.append(len(prompt))
            finished.append(done)
    if len(sources) > MAX_SOURCES:
        raise CorpusError(f"more than {MAX_SOURCES} sources in {', '.join(map(str, paths))}")
    flat = np.asarray(tokens, dtype=np.int64)
    if len(flat) and (flat.min() < 0 or flat.max() >= vocab_size):
        bad = int(flat.max() if flat.max() >= vocab_size else flat.min())
        raise CorpusError(f"token id {bad} is outside the vocabulary (vocab_size {vocab_size}): wrong target?")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    meta = {
        "target": target,
        "target_revision": target_revision,
        "vocab_size": int(vocab_size),
        "sampling": _sampling_dict(sampling),
        "created": _now(),
    }
    return Corpus(
        tokens=flat.astype(token_dtype(vocab_size)),
        offsets=offsets,
        prompt_lengths=np.asarray(prompt_lengths, dtype=np.int32),
        finished=np.asarray(finished, dtype=np.uint8),
        source_index=np.asarray(source_index, dtype=np.uint8),
        ids=ids,
        sources=list(sources),
        meta=meta,
    )


def merge(corpora: Sequence[Corpus]) -> Corpus:
    """Concatenate corpora of the same target and sampling; the first copy of an id wins, sources are
    united. Mixing targets or sampling settings would mislabel the data, so it is refused."""
    if not corpora:
        raise CorpusError("merge: no corpora")
    first = corpora[0]
    for other in corpora[1:]:
        for key in ("target", "target_revision", "vocab_size", "sampling"):
            if other.meta.get(key) != first.meta.get(key):
                raise CorpusError(
                    f"cannot merge corpora with different {key}: {first.meta.get(key)!r} vs {other.meta.get(key)!r}"
                )
    sources: dict[str, int] = {}
    remapped = []
    for corpus in corpora:
        table = np.asarray([sources.setdefault(name, len(sources)) for name in corpus.sources], dtype=np.int64)
        remapped.append(table[corpus.source_index] if len(table) else corpus.source_index.astype(np.int64))
    if len(sources) > MAX_SOURCES:
        raise CorpusError(f"merge: more than {MAX_SOURCES} sources")
    shifts = np.cumsum([0] + [c.num_tokens for c in corpora[:-1]])
    joined = Corpus(
        tokens=np.concatenate([c.tokens.astype(token_dtype(first.vocab_size), copy=False) for c in corpora]),
        offsets=np.concatenate(
            [[0]] + [c.offsets[1:] + shift for c, shift in zip(corpora, shifts, strict=True)]
        ).astype(np.int64),
        prompt_lengths=np.concatenate([c.prompt_lengths for c in corpora]).astype(np.int32),
        finished=np.concatenate([c.finished for c in corpora]).astype(np.uint8),
        source_index=np.concatenate(remapped).astype(np.uint8),
        ids=[i for c in corpora for i in c.ids],
        sources=list(sources),
        meta={**first.meta, "created": _now()},
    )
    firsts: dict[str, int] = {}
    for position, sample_id in enumerate(joined.ids):
        firsts.setdefault(sample_id, position)
    if len(firsts) == joined.num_samples:
        return joined
    return joined.select(np.fromiter(firsts.values(), dtype=np.int64, count=len(firsts)))
