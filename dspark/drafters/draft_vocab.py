"""A reduced draft vocabulary as a model feature, shared by every drafter model (DSpark/DFlash, EAGLE-3, MTP).

With `config.draft_vocab_size` set, the model owns buffers `d2t` (Vd,) int64 and `t2d` (V,) bool (EAGLE-3's
layout, saved with the weights; `dspark.drafters.vocab` has the pure maps) naming the draft vocabulary: its
logits are the target's frozen LM head restricted to those rows, so they are Vd wide; inputs (anchor,
previous tokens) stay target ids. Drafting maps a drawn draft id back to its target id and scatters q onto
the full vocabulary (zero elsewhere), which keeps rejection sampling exactly lossless.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspark.drafters.vocab import check_target_ids, ids_from_offsets, offsets_from_ids, t2d_mask, target_to_draft_map
from dspark.errors import DrafterLoadError
from dspark.packed import PackedLinear, pack_linear, packed_by_default


def check_draft_vocab_size(draft_vocab_size: int | None, vocab_size: int) -> None:
    if draft_vocab_size is not None and not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")


class DraftVocabMixin:
    """For an nn.Module whose `config` has `vocab_size` and `draft_vocab_size` (None = full vocabulary).
    Call `init_draft_vocab()` in `__init__`, after `nn.Module.__init__`."""

    config: object
    device: torch.device

    def init_draft_vocab(self) -> None:
        self._sliced_head: tuple | None = None  # cache of the LM head rows of the draft vocabulary
        if self.config.draft_vocab_size is not None:
            first_ids = torch.arange(self.config.draft_vocab_size)
            self.register_buffer("d2t", offsets_from_ids(first_ids))
            self.register_buffer("t2d", t2d_mask(first_ids, self.config.vocab_size))

    @property
    def reduced_vocab(self) -> bool:
        return self.config.draft_vocab_size is not None

    @property
    def draft_vocab_size(self) -> int:
        """Vd, the number of logits the drafter produces (= V without a reduced vocabulary)."""
        return self.config.draft_vocab_size or self.config.vocab_size

    def draft_to_target(self) -> torch.Tensor:
        """(Vd,) int64: the target id of each draft id (ascending)."""
        if not self.reduced_vocab:
            return torch.arange(self.config.vocab_size, device=self.device)
        return ids_from_offsets(self.d2t)

    def target_to_draft(self) -> torch.Tensor:
        """(V,) int64: the draft id of each target id, -1 for ids outside the draft vocabulary."""
        return target_to_draft_map(self.draft_to_target(), self.config.vocab_size)

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Make `target_ids` (Vd distinct target ids, any order; see `vocab.select_draft_vocab`) the
        draft vocabulary. Weights indexed by draft id follow the new ids' order, so call this before training."""
        if not self.reduced_vocab:
            raise ValueError("this drafter predicts the full vocabulary: build it with draft_vocab_size=...")
        ids = torch.as_tensor(target_ids)
        if ids.dim() == 1 and not ids.dtype.is_floating_point:
            ids = ids.long().sort().values
        check_target_ids(ids, self.config.draft_vocab_size, self.config.vocab_size)
        ids = ids.to(self.d2t.device)
        self.d2t.copy_(offsets_from_ids(ids))
        self.t2d.copy_(t2d_mask(ids, self.config.vocab_size))
        self._sliced_head = None

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (any shape): i + d2t[i]."""
        return draft_ids + self.d2t[draft_ids] if self.reduced_vocab else draft_ids

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids (any shape), -1 outside the draft vocabulary or for negative ids
        (ignored labels): how training labels are mapped onto the Vd logits."""
        if not self.reduced_vocab:
            return target_ids.where(target_ids >= 0, -1)
        mapped = self.target_to_draft().to(target_ids.device)[target_ids.clamp(min=0)]
        return mapped.where(target_ids >= 0, -1)

    def scatter_to_target(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """(..., Vd) draft probabilities -> (..., V), zero outside the draft vocabulary: the q that
        verification needs (the same numbers, placed at their target ids)."""
        if not self.reduced_vocab:
            return draft_probs
        full = draft_probs.new_zeros(*draft_probs.shape[:-1], self.config.vocab_size)
        return full.index_copy_(-1, self.draft_to_target().to(draft_probs.device), draft_probs)

    def draft_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits (..., Vd) of final hidden states (..., D): the target's frozen LM head, restricted to the
        draft vocabulary when it is reduced."""
        hidden = hidden.to(lm_head.weight.dtype)
        if not self.reduced_vocab:
            return lm_head(hidden)
        weight, bias, packed = self._draft_lm_head(lm_head)
        return F.linear(hidden, weight, bias) if packed is None else packed(hidden)

    def draft_head(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The dense weight (Vd, D) and bias of the draft LM head: the target head's rows of the draft ids, or the
        head itself with the full vocabulary (for a forward that packs its own weights, `torch.compile`)."""
        if not self.reduced_vocab:
            return lm_head.weight, getattr(lm_head, "bias", None)
        weight, bias, _ = self._draft_lm_head(lm_head)
        return weight, bias

    def _draft_lm_head(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, PackedLinear | None]:
        """The target LM head's rows (and bias) of the draft ids, and their oneDNN-packed form on CPUs with
        native bf16 (`dspark.packed`: the same numbers, used only where no gradient is recorded). Cached:
        slicing Vd rows of a 49k-row head every round would cost as much as a drafter layer. The head is
        frozen, so the slice is detached and never saved; it is rebuilt when the head (tensor, dtype,
        device) or d2t changes, and made outside inference mode so a model that drafted can still be trained."""
        weight = lm_head.weight
        key = (weight.data_ptr(), weight.dtype, weight.device, self.d2t.device)
        cached = self._sliced_head
        if cached is None or cached[0] != key or not torch.equal(cached[1], self.d2t):
            with torch.inference_mode(False), torch.no_grad():
                ids = self.draft_to_target().to(weight.device)
                bias = getattr(lm_head, "bias", None)
                rows = weight.detach()[ids]
                row_bias = None if bias is None else bias.detach()[ids]
                packed = (pack_linear(rows, row_bias) if packed_by_default(rows.dtype, rows.device, rows.numel())
                          else None)
                self._sliced_head = (key, self.d2t.clone(), rows, row_bias, packed)
        return self._sliced_head[2], self._sliced_head[3], self._sliced_head[4]


def check_draft_vocab_weights(weights: dict[str, torch.Tensor], draft_vocab_size: int | None, vocab_size: int,
                              path: str | Path) -> None:
    """Refuse d2t/t2d that do not describe `draft_vocab_size` distinct ascending target ids: a wrong map
    would silently draft other tokens than the ones the drafter learnt (still lossless, but useless)."""
    if draft_vocab_size is None:
        return  # stray d2t/t2d in a full-vocabulary checkpoint are reported as unexpected weights
    if "d2t" not in weights or "t2d" not in weights:
        raise DrafterLoadError(f"drafter {path} has draft_vocab_size {draft_vocab_size} "
                               "but its weights hold no d2t / t2d draft vocabulary")
    d2t, t2d = weights["d2t"], weights["t2d"]
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or d2t.dim() != 1:
        raise DrafterLoadError(f"drafter {path}: d2t must be 1-D integer offsets, got {d2t.dtype} "
                               f"{tuple(d2t.shape)}")
    if d2t.shape[0] != draft_vocab_size:
        raise DrafterLoadError(f"drafter {path}: d2t has {d2t.shape[0]} entries but draft_vocab_size is "
                               f"{draft_vocab_size}")
    ids = ids_from_offsets(d2t)
    try:
        check_target_ids(ids, draft_vocab_size, vocab_size)
    except ValueError as error:
        raise DrafterLoadError(f"drafter {path}: d2t is invalid: {error}") from error
    if t2d.shape != (vocab_size,) or not torch.equal(t2d.bool(), t2d_mask(ids, vocab_size)):
        raise DrafterLoadError(f"drafter {path}: t2d does not match d2t (it must mark exactly the d2t target ids)")
