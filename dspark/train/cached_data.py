"""Training batches from the committed corpus and its offline feature cache.

The online trainer runs the target on every batch; here each sequence's context features and top-k
teacher come from `feature_cache.FeatureCache`, so a step is the drafter's forward and backward only.
Samples are the corpus samples cut to the cache's `max_len`; anchors, labels and teacher positions are
chosen exactly as in the online path (`anchors.py`), so the two pipelines train the same function.
"""

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.train.anchors import sample_anchors, target_positions
from dspark.train.feature_cache import FeatureCache
from dspark.train.losses import TopKTeacher
from dspark.train.online_features import TargetFeatureSource


@dataclass
class CachedExample:
    index: int  # corpus / cache sample
    input_ids: list[int]
    answer_start: int
    sample_id: str = ""  # the corpus sample id: what the held-out split is keyed by


@dataclass
class Batch:
    """A padded batch with its anchors, as `pad_and_anchor` makes it (the online pipeline's batch)."""

    input_ids: torch.Tensor  # (B, T) right-padded
    attention_mask: torch.Tensor  # (B, T)
    answer_mask: torch.Tensor  # (B, T) bool
    anchors: torch.Tensor  # (B, A)
    keep: torch.Tensor  # (B, A) bool: real anchors (not padding)


@dataclass
class CachedBatch(Batch):
    """A `Batch` with its context features and top-k teacher read from the feature cache."""

    features: torch.Tensor  # (B, T, F) bfloat16, zero on padding
    teacher: TopKTeacher  # at the teacher positions of every block, (B, A, γ, k)


def cached_examples(corpus, cache: "FeatureCache | TargetFeatureSource") -> list[CachedExample]:
    """The corpus samples as the cache holds them (cut to its max_len); samples with fewer than two
    answer tokens left are dropped (no anchor)."""
    if cache.num_samples != corpus.num_samples:
        raise ValueError(f"the cache holds {cache.num_samples} samples, the corpus {corpus.num_samples}")
    examples = []
    for index in range(corpus.num_samples):
        length = cache.length(index)
        start = int(corpus.offsets[index])
        prompt = int(corpus.prompt_lengths[index])
        if length - prompt >= 2:
            ids = corpus.tokens[start : start + length].astype(np.int64).tolist()
            examples.append(CachedExample(index, ids, prompt, corpus.ids[index]))
    return examples


def pad_and_anchor(examples: list, seeds: list[int], num_anchors: int, pad_id: int):
    """Right-padded input_ids / attention_mask / answer_mask (B, T) of examples with `input_ids` and
    `answer_start`, and each row's anchors and keep flags (lists of (A,)), one seeded generator per row."""
    length = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(examples), length, dtype=torch.long)
    answer_mask = torch.zeros(len(examples), length, dtype=torch.bool)
    anchors, keep = [], []
    for row, (example, seed) in enumerate(zip(examples, seeds, strict=True)):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        attention_mask[row, :n] = 1
        answer_mask[row, example.answer_start : n] = True
        a, k = sample_anchors(answer_mask[row], num_anchors, torch.Generator().manual_seed(seed))
        anchors.append(a)
        keep.append(k)
    return input_ids, attention_mask, answer_mask, anchors, keep


def make_cached_batch(examples: list[CachedExample], cache: "FeatureCache | TargetFeatureSource",
                      layers: tuple[int, ...], seeds: list[int], num_anchors: int, block_size: int, pad_id: int,
                      device: torch.device) -> CachedBatch:
    """Pad the examples, sample their anchors and gather features and teacher from the cache (or from
    the target, computed for these samples)."""
    input_ids, attention_mask, answer_mask, anchors, keep = pad_and_anchor(examples, seeds, num_anchors, pad_id)
    length, rows = input_ids.shape[1], len(examples)
    samples = cache.samples([example.index for example in examples], layers)
    # blocks past the longest answer are padding in every row: drop them (with every answer position an
    # anchor, a fixed anchors_per_seq would mostly be padding)
    used = max(int(k.sum()) for k in keep) or 1
    anchors_t, keep_t = torch.stack(anchors)[:, :used], torch.stack(keep)[:, :used]
    features = torch.zeros(rows, length, samples[0].hidden.shape[-1], dtype=torch.bfloat16)
    top_k = samples[0].topk_ids.shape[-1]
    ids = torch.zeros(rows, length, top_k, dtype=torch.long)
    logits = torch.zeros(rows, length, top_k)
    lse = torch.zeros(rows, length)
    for row, sample in enumerate(samples):
        n = sample.hidden.shape[0]
        features[row, :n], ids[row, :n], logits[row, :n], lse[row, :n] = (
            sample.hidden, sample.topk_ids, sample.topk_logits, sample.logsumexp)
    positions = target_positions(anchors_t, block_size, length).flatten(1)  # (B, A·γ)
    shape = (*anchors_t.shape, block_size)

    def gather(values: torch.Tensor) -> torch.Tensor:
        index = positions if values.ndim == 2 else positions[..., None].expand(-1, -1, values.shape[-1])
        out = values.gather(1, index)
        return out.view(*shape, *out.shape[2:])

    teacher = TopKTeacher(gather(ids).to(device), gather(logits).to(device), gather(lse).to(device))
    return CachedBatch(input_ids.to(device), attention_mask.to(device), answer_mask.to(device),
                       anchors_t.to(device), keep_t.to(device), features.to(device), teacher)


def answer_mask(corpus) -> np.ndarray:
    """(N,) bool over corpus.tokens: True on answer tokens."""
    edges = np.zeros(len(corpus.tokens) + 1, dtype=np.int64)
    np.add.at(edges, corpus.offsets[:-1] + corpus.prompt_lengths, 1)
    np.add.at(edges, corpus.offsets[1:], -1)
    return np.cumsum(edges)[:-1] > 0


def token_counts(corpus, vocab_size: int) -> np.ndarray:
    """How often each target id appears among the corpus *answer* tokens (what the draft must name)."""
    return np.bincount(corpus.tokens[answer_mask(corpus)].astype(np.int64), minlength=vocab_size)


def split_heldout(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices), a seeded split; at least one training example."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    num_eval = min(math.ceil(count * fraction), count - 1)
    return sorted(order[num_eval:]), sorted(order[:num_eval])


def split_by_id(sample_ids: Sequence[str], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices) decided per sample by a seeded hash of its id, so a corpus that
    grows never moves a sample from one side to the other (a randperm over the count would, and a drafter
    continued on the grown corpus would then be evaluated on answers it trained on). At least one sample on
    each side when there are two or more."""
    keys = [int.from_bytes(hashlib.blake2b(f"{seed}\0{i}".encode(), digest_size=8).digest(), "big") / 2**64
            for i in sample_ids]
    held = [k < fraction for k in keys]
    if len(keys) >= 2 and fraction > 0 and not any(held):
        held[min(range(len(keys)), key=keys.__getitem__)] = True
    if all(held) and keys:
        held[max(range(len(keys)), key=keys.__getitem__)] = False
    return [i for i, h in enumerate(held) if not h], [i for i, h in enumerate(held) if h]


def heldout_samples(corpus, max_len: int, fraction: float, seed: int) -> list[int]:
    """Corpus indices of the samples `dspark train` holds out with this fraction and seed (the same
    filter as `cached_examples`, the same split), so evaluation can roll out exactly those prompts."""
    lengths = np.minimum(np.diff(corpus.offsets), max_len) - corpus.prompt_lengths
    usable = np.flatnonzero(lengths >= 2)
    _, heldout = split_by_id([corpus.ids[i] for i in usable], fraction, seed)
    return [int(usable[i]) for i in heldout]
