"""Evaluation prompts in DeepSpec's format: one `{"turns": [...]}` (or `{"messages": [...]}`) per line."""

import json
from collections.abc import Sequence
from pathlib import Path

from dspark.errors import DsparkError


def dataset_name(path: str | Path) -> str:
    """Benchmark name of a prompt file: its stem, lower case, with '_' read as '-'."""
    return Path(path).stem.lower().replace("_", "-")


def default_dataset(name: str) -> Path:
    """shared/eval_datasets/<name>.jsonl in the working directory or one above it."""
    for root in (Path.cwd(), *Path.cwd().parents):
        path = root / "shared" / "eval_datasets" / f"{name}.jsonl"
        if path.is_file():
            return path
    raise DsparkError(f"no shared/eval_datasets/{name}.jsonl above {Path.cwd()}; pass --dataset")


def load_prompts(path: str | Path, num_prompts: int | None = None) -> list[str]:
    """First user turn of each record, in file order."""
    path = Path(path)
    if not path.is_file():
        raise DsparkError(f"dataset not found: {path}")
    prompts: list[str] = []
    with path.open() as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DsparkError(f"{path}:{line_number}: not valid JSON ({error.msg})") from error
            prompts.append(_first_turn(record, path, line_number))
            if num_prompts is not None and len(prompts) >= num_prompts:
                break
    if not prompts:
        raise DsparkError(f"dataset {path} holds no prompts")
    return prompts


def load_dataset_prompts(paths: Sequence[str | Path], num_prompts: int) -> list[tuple[str, str]]:
    """(dataset name, prompt) for the first `num_prompts` of each file; a stem given twice gets '#2'."""
    prompts, seen = [], {}
    for path in paths:
        name = dataset_name(path)
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name}#{seen[name]}"  # same stem twice: keep both apart
        prompts += [(label, prompt) for prompt in load_prompts(path, num_prompts)]
    return prompts


def _first_turn(record: dict, path: Path, line_number: int) -> str:
    if isinstance(record, dict) and record.get("turns"):
        return str(record["turns"][0])
    if isinstance(record, dict) and record.get("messages"):
        users = [m["content"] for m in record["messages"] if m.get("role") == "user"]
        if users:
            return str(users[0])
    raise DsparkError(f"{path}:{line_number}: expected a 'turns' or 'messages' field")
