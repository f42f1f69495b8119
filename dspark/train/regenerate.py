"""Self-distillation data: the target answers the training prompts itself.

A drafter learns to predict the target, so its training answers must be the target's own
(regenerating them matters a lot for the acceptance length τ). Generation is slow on a CPU, so the
job is resumable: every finished sample is appended to the output JSONL at once, and a restart skips
the ids already there (cutting off a line half-written by a kill), so nothing is lost or duplicated.
"""

import json
import os
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dspark.batch_decode import decode_rows
from dspark.sampling import SamplingParams
from dspark.train.data import DataError, Prompt

# SmolLM2-Instruct's model card recommends temperature 0.2, top-p 0.9.
DEFAULT_TEMPERATURE = 0.2
DEFAULT_TOP_P = 0.9


@dataclass
class SamplingConfig:
    """How answers are sampled; temperature 0 means greedy."""

    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    max_new_tokens: int = 256


@dataclass
class RegenerateStats:
    done_before: int = 0
    generated: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"done_before": self.done_before, "generated": self.generated, "new_tokens": self.new_tokens,
                "seconds": round(self.seconds, 2), "tokens_per_s": round(self.tokens_per_s, 2)}


def recommended_sampling(model: PreTrainedModel, max_new_tokens: int = 256) -> SamplingConfig:
    """The target's own sampling settings when its generation config has them, else SmolLM2's."""
    config = model.generation_config
    if getattr(config, "do_sample", False) and getattr(config, "temperature", None):
        return SamplingConfig(config.temperature, getattr(config, "top_p", None) or 1.0, max_new_tokens)
    return SamplingConfig(max_new_tokens=max_new_tokens)


def completed_ids(path: Path) -> set[str]:
    """Ids already in the output file. A last line without its newline was cut by a kill: it is
    truncated away (and regenerated). A complete line that is not valid JSON is an error."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    ids = set()
    for lineno, line in enumerate(data[:complete].splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise DataError(f"{path}:{lineno}: not a regenerated sample; refusing to append to this file") from None
    if complete < len(data):
        print(f"[dspark] {path}: dropping a half-written last line ({len(data) - complete} bytes)", file=sys.stderr)
        with path.open("r+b") as out:
            out.truncate(complete)
    return ids


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """The prompt as the target sees it in chat: its chat template, ending with the assistant header."""
    text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def plan_batches(lengths: list[int], batch_size: int, window: int) -> Iterator[list[int]]:
    """Indices in batches; within each window of `window` prompts, sorted by length so that a batch
    wastes little on padding while the file order (and thus the source mix) is roughly kept."""
    for start in range(0, len(lengths), window):
        chunk = sorted(range(start, min(start + window, len(lengths))), key=lambda i: lengths[i])
        for first in range(0, len(chunk), batch_size):
            yield chunk[first : first + batch_size]


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding: every row's last prompt token is at the same position, where generation starts."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in ids if i is not None]


def generate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[list[int]],
    sampling: SamplingConfig,
    seed: int,
) -> list[tuple[list[int], bool]]:
    """(answer token ids, ending with the EOS token when one was emitted; whether it was) per prompt row."""
    stop = eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop[0] if stop else 0)
    ids, mask = left_pad(rows, pad_id)
    params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p if sampling.temperature else 1.0)
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        produced = decode_rows(model, ids, mask, sampling.max_new_tokens, params, generator, stop)
    answers = []
    for row in produced:
        finished = bool(row) and row[-1] in stop
        answers.append((row, finished))
    return answers


def batch_seed(seed: int, ids: list[str]) -> int:
    """A seed fixed by the batch's content, so a rerun of the same batch samples the same answers."""
    return zlib.crc32(f"{seed}:{','.join(ids)}".encode())


def regenerate(
    prompts: list[Prompt],
    out_path: str | Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingConfig | None = None,
    batch_size: int = 8,
    limit: int | None = None,
    seed: int = 0,
    window: int | None = None,
    skip_ids: set[str] | None = None,
) -> RegenerateStats:
    """Answer every prompt not yet in `out_path` (at most `limit` of them this run), appending one
    `{"id", "source", "messages": [..., assistant], "num_tokens", "finished", "prompt_ids", "answer_ids"}`
    line per sample (`finished`: the answer ended with EOS rather than at `max_new_tokens`). Prompts whose ids
    are in `skip_ids` (e.g. those of a committed corpus) count as done already."""
    sampling = sampling or recommended_sampling(model)
    if tokenizer.chat_template is None:
        raise DataError("the target's tokenizer has no chat template")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = completed_ids(out_path) | (skip_ids or set())
    stats = RegenerateStats(done_before=sum(p.id in done for p in prompts))
    todo = [p for p in prompts if p.id not in done][:limit]
    rows = [prompt_token_ids(tokenizer, p) for p in todo]
    batches = plan_batches([len(r) for r in rows], batch_size, window or 16 * batch_size)
    interactive = sys.stderr.isatty()
    bar = tqdm(total=stats.done_before + len(todo), initial=stats.done_before, unit="sample",
               desc="regenerate", mininterval=0.5 if interactive else 30, dynamic_ncols=interactive)
    start = time.perf_counter()
    with out_path.open("a", encoding="utf-8") as out, bar:
        for batch in batches:
            ids = [todo[i].id for i in batch]
            answers = generate_batch(model, tokenizer, [rows[i] for i in batch], sampling, batch_seed(seed, ids))
            for i, (tokens, finished) in zip(batch, answers, strict=True):
                sample = _sample(todo[i], tokenizer, rows[i], tokens, finished)
                out.write(json.dumps(sample, ensure_ascii=False) + "\n")
                stats.new_tokens += len(tokens)
            out.flush()
            os.fsync(out.fileno())
            stats.generated += len(batch)
            stats.seconds = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{stats.tokens_per_s:.1f}", refresh=False)
            bar.update(len(batch))
    return stats


def _sample(prompt: Prompt, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], answer_ids: list[int],
            finished: bool) -> dict[str, Any]:
    """One output line. `prompt_ids`/`answer_ids` are the exact tokens the target saw and sampled
    (`answer_ids` ends with the EOS token when `finished`): decoding and re-encoding the text does not
    always give them back, and training should see the target's own tokens."""
    text = tokenizer.decode(answer_ids, skip_special_tokens=True)
    messages = prompt.messages + [{"role": "assistant", "content": text}]
    return {"id": prompt.id, "source": prompt.source, "messages": messages,
            "num_tokens": len(answer_ids) - finished, "finished": finished,
            "prompt_ids": prompt_ids, "answer_ids": answer_ids}
