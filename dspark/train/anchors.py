"""Anchor sampling: where the training blocks start.

A block anchored at position a is what the drafter sees at inference right after the target emitted
token x_a: context features of positions < a, the anchor token x_a itself, and labels x_{a+1..a+γ}.
At inference the anchor is always a generated token, so anchors are answer tokens whose next token is
an answer token too. Labels past the answer end (or the sequence end) are masked, and so is everything
after the first masked label (only a contiguous prefix of a block can be accepted).
"""

import torch


def candidate_anchors(answer_mask: torch.Tensor) -> torch.Tensor:
    """Positions a (n,) with answer_mask[a] and answer_mask[a+1], for one sequence (T,) bool."""
    mask = answer_mask.bool()
    return (mask[:-1] & mask[1:]).nonzero().flatten()


def sample_anchors(
    answer_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` distinct anchors of one sequence, sorted, drawn uniformly without replacement.
    Returns (anchors (A,), keep (A,)); when there are fewer candidates the rest are dummies at 0 with
    keep False."""
    candidates = candidate_anchors(answer_mask.cpu())
    count = min(num_anchors, candidates.numel())
    chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]].sort().values
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    keep = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[:count], keep[:count] = chosen, True
    return anchors.to(answer_mask.device), keep.to(answer_mask.device)


def block_labels(
    input_ids: torch.Tensor, answer_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels x_{a+k} and their validity, both (B, A, γ), for input_ids / answer_mask (B, T) and anchors /
    keep (B, A). A label is valid while every label before it in the block is an answer token."""
    length = input_ids.shape[1]
    positions = anchors[..., None] + torch.arange(1, block_size + 1, device=anchors.device)  # (B, A, γ)
    inside = positions < length
    safe = positions.clamp(max=length - 1).flatten(1)
    labels = input_ids.gather(1, safe).view_as(positions)
    valid = inside & answer_mask.bool().gather(1, safe).view_as(positions) & keep[..., None]
    valid = valid.long().cumprod(-1).bool()
    return labels, valid


def target_positions(anchors: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Positions a + k - 1 (B, A, γ) whose target distribution p_k predicts label x_{a+k}."""
    positions = anchors[..., None] + torch.arange(block_size, device=anchors.device)
    return positions.clamp(max=length - 1)


def anchor_seed(seed: int, step: int, index: int) -> int:
    """Seed of the anchor generator of the `index`-th sequence of global batch `step`: independent of how
    the batch is split across ranks, so any world size samples the same blocks."""
    return (seed * 1_000_003 + step * 10_007 + index) % (2**62)
