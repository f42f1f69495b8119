"""Training examples from JSONL conversations, and the seeded order and padded batches of the online pipeline.

A global batch is a function of (seed, step) alone, so a resumed run replays the same data; the feature-cache
pipeline (`train.cached_data`) shares the padding and anchor sampling (`pad_and_anchor`) and `Batch`.
"""

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.errors import DsparkError
from dspark.train.cached_data import Batch, pad_and_anchor


@dataclass
class Example:
    input_ids: list[int]
    answer_start: int  # positions [answer_start, len) are the answer (assistant) tokens


def tokenize_conversation(messages: list[dict], tokenizer, finished: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) with the target's chat template; the last message is the answer. A finished
    answer ends with the end-of-turn token the target stopped at; an unfinished one (cut by the
    regeneration's token limit) does not."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("the last message must be the assistant's answer")
    prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer(prompt_text, add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    if full_text.startswith(prompt_text):
        answer = tokenizer(full_text[len(prompt_text):], add_special_tokens=False).input_ids
        if eos in answer:  # drop what the template adds after the end of turn (a newline)
            answer = answer[: answer.index(eos) + 1]
    else:
        answer = tokenizer(messages[-1]["content"], add_special_tokens=False).input_ids
        answer = answer + ([eos] if eos is not None else [])
    if not finished and answer and answer[-1] == eos:
        answer = answer[:-1]
    return prompt, answer


# duplicates: same JSONL loop as eval.datasets.load_prompts, with its own records and error messages — kept apart
def load_examples(path: str | Path, tokenizer, seq_len: int) -> list[Example]:
    """JSONL of {"messages": [...]} (needs the tokenizer) or pre-tokenised {"prompt_ids", "answer_ids"};
    sequences are cut to seq_len and dropped when fewer than 2 answer tokens remain."""
    path = Path(path)
    if not path.is_file():
        raise DsparkError(f"training data not found: {path}")
    examples = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if "prompt_ids" in record:
                    prompt, answer = list(record["prompt_ids"]), list(record["answer_ids"])
                elif "messages" in record:
                    if tokenizer is None:
                        raise ValueError("the target has no tokenizer: give prompt_ids/answer_ids")
                    prompt, answer = tokenize_conversation(record["messages"], tokenizer,
                                                           bool(record.get("finished", True)))
                else:
                    raise ValueError("expected 'messages' or 'prompt_ids'/'answer_ids'")
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise DsparkError(f"{path}:{number}: {error}") from error
            ids = (prompt + answer)[:seq_len]
            if len(ids) - len(prompt) >= 2:
                examples.append(Example([int(i) for i in ids], len(prompt)))
    if not examples:
        raise DsparkError(f"{path}: no usable conversation (each needs >= 2 answer tokens within seq_len)")
    return examples


def batch_indices(num_train: int, batch_size: int, step: int, seed: int,
                  lengths: Sequence[int] | None = None, group_batches: int = 0) -> list[int]:
    """Positions (into the training list) of global batch `step`: epoch e is a seeded permutation cut
    into full batches, so a batch is a function of the step alone (that is the data position).

    With `lengths` and `group_batches` > 1 (HF's `group_by_length`), each run of group_batches × batch_size
    samples of the permutation is sorted by length before it is cut, and its batches are then shuffled: a
    batch holds samples of similar length, so right-padding wastes ~2% of the target's and the drafter's
    work instead of ~30% (random batches of 4 default-corpus samples), while every sample is still seen
    once an epoch in a seeded random order."""
    per_epoch = max(num_train // batch_size, 1)
    epoch, index = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(seed * 7919 + epoch)
    order = torch.randperm(num_train, generator=generator).tolist()
    if num_train < batch_size:
        order = (order * math.ceil(batch_size / num_train))[:batch_size]
    elif lengths is not None and group_batches > 1:
        order = _grouped_by_length(order[: per_epoch * batch_size], lengths, batch_size, group_batches, generator)
    return order[index * batch_size : (index + 1) * batch_size]


def _grouped_by_length(order: list[int], lengths: Sequence[int], batch_size: int, group_batches: int,
                       generator: torch.Generator) -> list[int]:
    """`order` (whole batches) with each window of group_batches batches sorted by length (longest first),
    cut into batches, and those batches shuffled within the window."""
    grouped = []
    window = group_batches * batch_size
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: -lengths[i])
        batches = [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        for b in torch.randperm(len(batches), generator=generator).tolist():
            grouped += batches[b]
    return grouped


def make_batch(examples: list[Example], seeds: list[int], num_anchors: int, pad_id: int,
               device: torch.device) -> Batch:
    input_ids, attention_mask, answer_mask, anchors, keep = pad_and_anchor(examples, seeds, num_anchors, pad_id)
    return Batch(input_ids.to(device), attention_mask.to(device), answer_mask.to(device),
                 torch.stack(anchors).to(device), torch.stack(keep).to(device))


# -- distributed ---------------------------------------------------------------------------------
