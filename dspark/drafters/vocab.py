"""Reduced draft vocabularies (EAGLE-3 style): the drafter predicts only the Vd most frequent target tokens.

The drafter's LM head (the target's frozen head, sliced) and its Markov W2 then cost Vd/V of the full
vocabulary, which dominates a small drafter on a CPU. Verification stays exactly lossless: the draft's
q is scattered back onto the full vocabulary with zeros outside the subset, and rejection sampling
only needs q to be the distribution the draft token was drawn from. The price is acceptance: a target
token outside the subset can never be drafted, so report `coverage`.

Stored as EAGLE-3 does: `d2t` (Vd,) int64 offsets, draft id i ↦ target id i + d2t[i] with the target ids
sorted ascending, and `t2d` (V,) bool, True for target ids inside the subset. Pure functions only.
"""

from collections.abc import Iterable

import numpy as np
import torch


def _as_tensor(values: np.ndarray | torch.Tensor) -> torch.Tensor:
    return values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))


def count_tokens(token_ids: np.ndarray | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Corpus counts (V,) int64 of every target id; negative ids (padding, ignored labels) are skipped."""
    ids = _as_tensor(token_ids).long().flatten()
    ids = ids[ids >= 0]
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(f"token id {int(ids.max())} outside the vocabulary ({vocab_size})")
    return torch.bincount(ids, minlength=vocab_size)


def select_draft_vocab(counts: np.ndarray | torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` target ids (int64, sorted ascending) with the largest corpus counts (ties: lower id first),
    always including `always` (EOS, chat special tokens: they must stay draftable even if rare)."""
    counts = _as_tensor(counts).double().flatten()
    vocab_size = counts.shape[0]
    forced = sorted({int(i) for i in always})
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    if forced and not 0 <= forced[0] <= forced[-1] < vocab_size:
        raise ValueError(f"`always` ids must be in [0, {vocab_size}), got {forced}")
    if len(forced) > size:
        raise ValueError(f"{len(forced)} `always` ids do not fit a draft vocabulary of {size}")
    chosen = torch.zeros(vocab_size, dtype=torch.bool)
    chosen[forced] = True
    # stable sort of -count: the most frequent first, equal counts in id order
    by_frequency = torch.sort(-counts, stable=True).indices
    rest = by_frequency[~chosen[by_frequency]][: size - len(forced)]
    chosen[rest] = True
    return chosen.nonzero().flatten()


def coverage(counts: np.ndarray | torch.Tensor, ids: np.ndarray | torch.Tensor) -> float:
    """Fraction of the counted tokens whose id is in `ids`: an upper bound on how often the target's
    next token can be drafted at all."""
    counts = _as_tensor(counts).double().flatten()
    total = float(counts.sum())
    if total <= 0:
        raise ValueError("coverage of an empty count")
    return float(counts[_as_tensor(ids).long()].sum()) / total


def carry_rows(rows: torch.Tensor, old_ids: torch.Tensor, new_ids: torch.Tensor) -> torch.Tensor:
    """Rows (Vd_old, ...) indexed by the draft ids of the vocabulary `old_ids` (target ids, draft order)
    re-indexed for the vocabulary `new_ids`: an id in both keeps its trained row, a new id gets zeros (a
    Markov W2 row of zero adds nothing to the frozen head's logit, so it starts as the target's head alone)."""
    old_ids, new_ids = old_ids.long().to(rows.device), new_ids.long().to(rows.device)
    if rows.shape[0] != old_ids.shape[0]:
        raise ValueError(f"{rows.shape[0]} rows for a vocabulary of {old_ids.shape[0]} ids")
    size = int(max(old_ids.max(), new_ids.max())) + 1
    draft_id = torch.full((size,), -1, dtype=torch.long, device=rows.device)
    draft_id[old_ids] = torch.arange(old_ids.shape[0], device=rows.device)
    source = draft_id[new_ids]
    kept = source >= 0
    carried = rows.new_zeros(new_ids.shape[0], *rows.shape[1:])
    carried[kept] = rows[source[kept]]
    return carried


def offsets_from_ids(target_ids: torch.Tensor) -> torch.Tensor:
    """d2t (Vd,) int64 for ascending target ids: d2t[i] = target_ids[i] - i."""
    target_ids = target_ids.long()
    return target_ids - torch.arange(target_ids.shape[0], device=target_ids.device)


def ids_from_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids (Vd,) int64 of the draft ids 0..Vd-1: i + d2t[i]."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()


def t2d_mask(target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d (V,) bool: True for target ids inside the draft vocabulary (EAGLE-3's saved form)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=target_ids.device)
    mask[target_ids.long()] = True
    return mask


def target_to_draft_map(target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) int64: the draft id of each target id, -1 outside the subset (training labels map through it)."""
    mapping = torch.full((vocab_size,), -1, dtype=torch.long, device=target_ids.device)
    mapping[target_ids.long()] = torch.arange(target_ids.shape[0], device=target_ids.device)
    return mapping


def check_target_ids(target_ids: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """ValueError unless target_ids is (draft_vocab_size,) integer, strictly increasing and inside [0, V)."""
    if target_ids.dtype.is_floating_point or target_ids.dtype == torch.bool or target_ids.dim() != 1:
        raise ValueError(f"draft vocabulary must be a 1-D integer tensor, got {target_ids.dtype} "
                         f"{tuple(target_ids.shape)}")
    if target_ids.shape[0] != draft_vocab_size:
        raise ValueError(f"draft vocabulary has {target_ids.shape[0]} ids, draft_vocab_size is {draft_vocab_size}")
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary points outside the target vocabulary [0, {vocab_size}): "
                         f"ids {int(target_ids.min())}..{int(target_ids.max())}")
    if draft_vocab_size > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise ValueError("draft vocabulary target ids must be strictly increasing (sorted, no duplicates)")
