"""Training prompt records: the `Prompt`, parsing JSONL records, writing prompt files, deduplication and
keeping evaluation sets out (`EvalIndex`, `select_prompts`).

A prompt is a short conversation ending with a user turn. Only prompts are kept: `regenerate.py`
answers them with the target itself (self-distillation), because a drafter trained on the target's
own answers is accepted far more often than one trained on another model's answers. Where prompts come
from (user JSONL, ShareGPT, standard-library code) and the `dspark data prompts` pipeline are
`dspark.train.prompt_sources`.
"""

import hashlib
import json
import os
import random
import re
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.errors import DsparkError

ROLES = ("system", "user", "assistant")


class DataError(DsparkError):
    """A prompt source or evaluation file is missing or malformed."""


@dataclass
class Prompt:
    """One training prompt: `messages` ends with the user turn the target will answer."""

    id: str
    source: str
    messages: list[dict[str, str]]

    @property
    def text(self) -> str:
        """The user turns, which is what deduplication and exclusion compare."""
        return "\n".join(m["content"] for m in self.messages if m["role"] == "user")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "messages": self.messages}


def normalize(text: str) -> str:
    """Lower case, whitespace collapsed: trivially different copies compare equal."""
    return " ".join(text.lower().split())


def text_hash(text: str) -> str:
    return hashlib.sha1(normalize(text).encode()).hexdigest()


# ---------------------------------------------------------------- records and JSONL files


def messages_from_record(record: Any) -> list[dict[str, str]]:
    """Prompt messages of one JSONL record: `{"turns": [...]}`, `{"messages": [...]}` or a string.

    Only the first user turn is kept (with any system message before it): later user turns were
    written in reply to answers the target never gave, so they cannot be self-distilled as they are.
    Raises ValueError with the reason when the record is not usable.
    """
    if isinstance(record, str):
        record = {"turns": [record]}
    if not isinstance(record, dict):
        raise ValueError(f"expected an object or a string, got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError('"turns" must be a non-empty list of strings')
        if not turns[0].strip():
            raise ValueError("the first turn is empty")
        return [{"role": "user", "content": turns[0]}]
    if "messages" in record:
        return _prompt_messages(record["messages"])
    raise ValueError('expected a "turns" or a "messages" field')


def _prompt_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list')
    prompt = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(
            message.get("content"), str
        ):
            raise ValueError('each message needs "role" (system/user/assistant) and a string "content"')
        prompt.append({"role": message["role"], "content": message["content"]})
        if message["role"] == "user":
            if not message["content"].strip():
                raise ValueError("the first user message is empty")
            return prompt
        if message["role"] == "assistant":
            raise ValueError("an assistant message comes before the first user message")
    raise ValueError("no user message")

def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed record) of every non-blank line of a JSONL file."""
    if not path.is_file():
        raise DataError(f"file not found: {path}")
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{lineno}: not valid JSON ({error.msg})") from None


def write_prompts(path: str | Path, prompts: Iterable[Prompt]) -> None:
    """Write a prompts JSONL atomically, so a killed run never leaves a half file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        for prompt in prompts:
            out.write(json.dumps(prompt.to_json(), ensure_ascii=False) + "\n")
    os.replace(staging, path)


# ---------------------------------------------------------------- evaluation-set exclusion


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _shingles(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class EvalIndex:
    """Evaluation prompts that training must not see.

    A training prompt matches when its normalised text equals an evaluation turn, or when they share
    at least `min_overlap` of either one's word n-grams (so an evaluation prompt pasted inside a
    longer request, or lightly edited, is caught too). Evaluation turns shorter than n words are
    matched exactly only. An n-gram found in `boilerplate` or more evaluation turns is an instruction
    the set repeats ("Please reason step by step, and put your final answer within \\boxed{}."), not
    its content: it is left out of both sides of the overlap, so a new question asked with the same
    instruction is not taken for an evaluation prompt.
    """

    def __init__(self, texts: Iterable[str] = (), ngram: int = 8, min_overlap: float = 0.5,
                 boilerplate: int = 5) -> None:
        self.ngram, self.min_overlap, self.boilerplate = ngram, min_overlap, boilerplate
        self.exact: set[str] = set()
        self.turns: list[set[tuple[str, ...]]] = []
        self.postings: dict[tuple[str, ...], list[int]] = {}
        self._filtered: tuple[set[tuple[str, ...]], list[int]] | None = None
        for text in texts:
            self.add(text)

    def add(self, text: str) -> None:
        self.exact.add(normalize(text))
        shingles = set(_shingles(_words(text), self.ngram))
        if shingles:
            for shingle in shingles:
                self.postings.setdefault(shingle, []).append(len(self.turns))
            self.turns.append(shingles)
            self._filtered = None

    def _without_boilerplate(self) -> tuple[set[tuple[str, ...]], list[int]]:
        """The boilerplate n-grams and each turn's n-gram count without them (kept until the next add)."""
        if self._filtered is None:
            common = {s for s, turns in self.postings.items() if len(turns) >= self.boilerplate}
            self._filtered = common, [len(shingles - common) for shingles in self.turns]
        return self._filtered

    @property
    def common(self) -> set[tuple[str, ...]]:
        """The boilerplate n-grams (in `boilerplate` or more evaluation turns)."""
        return self._without_boilerplate()[0]

    @classmethod
    def from_files(cls, paths: Iterable[str | Path], **kwargs: Any) -> "EvalIndex":
        """Every turn of every record of evaluation JSONL files (`{"turns": [...]}` or messages)."""
        index = cls(**kwargs)
        for path in paths:
            for lineno, record in read_jsonl(Path(path)):
                turns = _eval_turns(record)
                if not turns:
                    raise DataError(f"{path}:{lineno}: expected a \"turns\" or \"messages\" field")
                for turn in turns:
                    index.add(turn)
        return index

    def matches(self, text: str) -> bool:
        if normalize(text) in self.exact:
            return True
        common, sizes = self._without_boilerplate()
        shingles = set(_shingles(_words(text), self.ngram)) - common
        shared = Counter(i for s in shingles for i in self.postings.get(s, ()))
        return any(
            count >= self.min_overlap * sizes[i] or count >= self.min_overlap * len(shingles)
            for i, count in shared.items()
        )


def _eval_turns(record: Any) -> list[str]:
    if isinstance(record, str):
        return [record]
    if not isinstance(record, dict):
        return []
    if isinstance(record.get("turns"), list):
        return [t for t in record["turns"] if isinstance(t, str)]
    if isinstance(record.get("messages"), list):
        return [m["content"] for m in record["messages"] if isinstance(m, dict) and isinstance(m.get("content"), str)]
    return []


# ---------------------------------------------------------------- selecting prompts


@dataclass
class SourceReport:
    kept: int = 0
    duplicates: int = 0
    excluded: int = 0


@dataclass
class BuildReport:
    sources: dict[str, SourceReport] = field(default_factory=dict)

    @property
    def excluded(self) -> int:
        return sum(s.excluded for s in self.sources.values())

    def summary(self) -> str:
        parts = [f"{name}: {s.kept} kept, {s.duplicates} duplicates, {s.excluded} excluded"
                 for name, s in self.sources.items()]
        return "; ".join(parts)


def select_prompts(
    sources: Iterable[tuple[str, Iterable[Prompt], int | None]],
    exclude: EvalIndex | None = None,
    seed: int = 0,
) -> tuple[list[Prompt], BuildReport]:
    """Take up to `limit` prompts from each (name, candidates, limit) source in candidate order,
    skipping duplicates (across all sources) and evaluation matches; the result is shuffled with
    `seed` so that a partly regenerated file still mixes every source."""
    seen: set[str] = set()
    ids: set[str] = set()
    selected: list[Prompt] = []
    report = BuildReport()
    for name, candidates, limit in sources:
        counts = report.sources.setdefault(name, SourceReport())
        for prompt in candidates:
            if limit is not None and counts.kept >= limit:
                break
            key = text_hash(prompt.text)
            if key in seen or prompt.id in ids:
                counts.duplicates += 1
            elif exclude is not None and exclude.matches(prompt.text):
                counts.excluded += 1
            else:
                seen.add(key)
                ids.add(prompt.id)
                selected.append(prompt)
                counts.kept += 1
    random.Random(seed).shuffle(selected)
    return selected, report
