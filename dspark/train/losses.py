"""DSpark training objective (paper section 3.3, Eqs. 8-12).

For every draft position k of a block: q_k = softmax(draft logits), p_k = softmax(target logits), both at
temperature 1, and x*_k the ground-truth next token. Each term is position-weighted by
w_k = exp(-(k-1)/λ) and averaged over the valid positions (Σ w·ℓ / Σ w):

    L = α_ce · CE(q_k, x*_k) + α_tv · ‖q_k − p_k‖₁ + α_conf · BCE(c_k, c*_k)

The distribution-matching term is the full L1 distance ‖q − p‖₁ (Eq. 10, = 2·TV), while the
confidence label is the acceptance probability of rejection sampling, c*_k = 1 − ½‖q_k − p_k‖₁
(Eq. 8), detached. DFlash is α = (1, 0, 0).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0


DSPARK_WEIGHTS = LossWeights(0.1, 0.9, 1.0)
DFLASH_WEIGHTS = LossWeights(1.0, 0.0, 0.0)


@dataclass
class LossOutput:
    """Every field is a scalar; `total` is the one to backpropagate."""

    total: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor  # weighted mean of ‖q − p‖₁ (the loss term, not halved)
    conf: torch.Tensor
    accept: torch.Tensor  # weighted mean of c* = 1 − ½‖q − p‖₁ (no grad)
    weight_sum: torch.Tensor  # Σ w over valid positions (the local normaliser)
    soft_label: torch.Tensor  # (..., γ) c* per position, detached


def position_weights(block_size: int, decay: float = 4.0, device: torch.device | str | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/λ) for k = 1..γ; λ <= 0 means uniform weights."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    if decay <= 0:
        return torch.ones_like(k)
    return torch.exp(-k / decay)


def l1_distance(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """‖q − p‖₁ over the last dim."""
    return (q - p).abs().sum(-1)


def acceptance_probability(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """c* = 1 − ½‖q − p‖₁ = Σ_x min(p, q): the chance rejection sampling accepts x ~ q."""
    return (1.0 - 0.5 * l1_distance(q, p)).clamp(0.0, 1.0)


def block_loss(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    confidence_logits: torch.Tensor | None = None,
    weights: LossWeights = DSPARK_WEIGHTS,
    decay: float = 4.0,
    normalizer: torch.Tensor | float | None = None,
) -> LossOutput:
    """Loss over blocks. logits / target_logits (..., γ, V), labels / valid (..., γ), confidence_logits
    (..., γ) or None. `normalizer` replaces the local Σw (data parallel: the global Σw / world size)."""
    w, weight_sum, norm = _weighting(logits, valid, decay, normalizer)
    log_q = F.log_softmax(logits.float(), -1)
    ce = -log_q.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    ce_term = (ce * w).sum() / norm

    q = log_q.exp()
    p = F.softmax(target_logits.float(), -1)
    l1 = l1_distance(q, p)
    return _combine(ce_term, l1, w, norm, weight_sum, confidence_logits, weights)


def _weighting(logits: torch.Tensor, valid: torch.Tensor, decay: float,
               normalizer: torch.Tensor | float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | float]:
    """(w, Σw, normaliser): the position weights of the valid positions of (..., γ, V) logits, their sum,
    and what every term is divided by (`normalizer`, else the local Σw)."""
    w = position_weights(logits.shape[-2], decay, logits.device) * valid.float()
    weight_sum = w.sum()
    return w, weight_sum, weight_sum.clamp_min(1e-6) if normalizer is None else normalizer


def _combine(ce_term: torch.Tensor, l1: torch.Tensor, w: torch.Tensor, norm, weight_sum: torch.Tensor,
             confidence_logits: torch.Tensor | None, weights: LossWeights) -> LossOutput:
    """The terms both teachers share once CE and ‖q − p‖₁ are known: the L1 term, the detached soft
    label c* = 1 − ½‖q − p‖₁, the confidence BCE against it, and the weighted total."""
    tv_term = (l1 * w).sum() / norm
    soft_label = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    conf_term = ce_term.new_zeros(())
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), soft_label, reduction="none")
        conf_term = (bce * w).sum() / norm
    total = weights.ce * ce_term + weights.tv * tv_term + weights.conf * conf_term
    accept = (soft_label * w).sum() / norm
    return LossOutput(total, ce_term.detach(), tv_term.detach(), conf_term.detach(), accept.detach(),
                      weight_sum.detach(), soft_label)


def block_tau(tv: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Expected acceptance length of each block, 1 + Σ_k Π_{i≤k} (1 − TV_i), for TV (..., γ) =
    ½‖q − p‖₁; invalid positions (past the answer end) are never accepted."""
    accept = (1.0 - tv).clamp(0.0, 1.0)
    if valid is not None:
        accept = accept * valid.float()
    return 1.0 + accept.cumprod(-1).sum(-1)


def expected_tau(tv: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of `block_tau` over the blocks with at least one valid position."""
    taus = block_tau(tv, valid)
    if valid is None:
        return taus.mean()
    keep = valid.any(-1)
    return taus[keep].mean() if keep.any() else taus.new_tensor(1.0)


def chained_rounds(accept: torch.Tensor) -> tuple[float, float]:
    """Expected (tokens, rounds) of a rollout over one answer whose every position is an anchor: `accept`
    (A, γ) holds, for the anchors in position order, the probability that draft k is accepted once drafts
    1..k−1 were (0/1 at T = 0). A round at anchor a that accepts L drafts commits L + 1 tokens and the next
    round starts at a + L + 1. The mean of `block_tau` over every anchor weighs each position once, but a
    rollout visits few positions where the drafts run long (one round covers L + 1 of them), so that mean
    overstates a rollout's tokens per round more the longer the runs; tokens / rounds here is the rollout's
    own ratio (exact at T = 0, in expectation over the acceptance draws at T = 1)."""
    num_anchors, gamma = accept.shape
    survive = accept.double().clamp(0.0, 1.0).cumprod(-1)  # P(L ≥ k), k = 1..γ
    at_least = torch.cat([survive.new_ones(num_anchors, 1), survive], 1)  # P(L ≥ l), l = 0..γ
    length_p = (at_least - torch.cat([survive, survive.new_zeros(num_anchors, 1)], 1)).tolist()  # P(L = n)
    tokens, rounds = [0.0] * (num_anchors + gamma + 2), [0.0] * (num_anchors + gamma + 2)
    for a in range(num_anchors - 1, -1, -1):
        probs = length_p[a]
        rounds[a] = 1.0 + sum(p * rounds[a + n + 1] for n, p in enumerate(probs))
        tokens[a] = sum(p * (n + 1 + tokens[a + n + 1]) for n, p in enumerate(probs))
    return tokens[0], rounds[0]


@dataclass
class TopKTeacher:
    """The target's next-token distribution as cached: its k most likely ids (..., k), their logits
    (..., k) and the logsumexp of the full logits (...,). p is exact on the top-k; the rest of the
    vocabulary is one tail bucket of mass 1 - Σ p_top."""

    ids: torch.Tensor
    logits: torch.Tensor
    logsumexp: torch.Tensor

    def probs(self) -> torch.Tensor:
        return (self.logits.float() - self.logsumexp.float()[..., None]).exp()

    @property
    def argmax(self) -> torch.Tensor:
        return self.ids[..., 0]

    def select(self, index) -> "TopKTeacher":
        """The teacher at `index` of its leading (position) dimensions, e.g. (slice(None), rows)."""
        return TopKTeacher(self.ids[index], self.logits[index], self.logsumexp[index])


def topk_l1_distance(log_q: torch.Tensor, teacher: TopKTeacher, target_to_draft: torch.Tensor | None) -> torch.Tensor:
    """‖q − p‖₁ with the vocabulary coarsened to the teacher's top-k ids plus one tail bucket, for draft
    log-probabilities log_q (..., V_d) over the draft vocabulary (`target_to_draft` maps target ids to draft
    ids, -1 outside; None = the full vocabulary). A lower bound of the full L1 that equals it when the
    top-k covers every token either distribution puts mass on (and exactly when k = V)."""
    ids = teacher.ids if target_to_draft is None else target_to_draft[teacher.ids]
    inside = ids >= 0
    q_top = log_q.gather(-1, ids.clamp_min(0)).exp() * inside
    p_top = teacher.probs()
    q_tail = (1.0 - q_top.sum(-1)).clamp_min(0.0)
    p_tail = (1.0 - p_top.sum(-1)).clamp_min(0.0)
    return (q_top - p_top).abs().sum(-1) + (q_tail - p_tail).abs()


# duplicates: the same parameters as block_loss on purpose (a drop-in for it with a cached teacher)
def topk_block_loss(
    logits: torch.Tensor,
    teacher: TopKTeacher,
    labels: torch.Tensor,
    valid: torch.Tensor,
    confidence_logits: torch.Tensor | None = None,
    weights: LossWeights = DSPARK_WEIGHTS,
    decay: float = 4.0,
    normalizer: torch.Tensor | float | None = None,
    target_to_draft: torch.Tensor | None = None,
) -> LossOutput:
    """`block_loss` against a cached top-k teacher instead of the target's full logits: the draft side
    needs one log-softmax over its own (possibly reduced) vocabulary, the teacher side none.
    logits (..., γ, V_d); labels (..., γ) target ids (a label outside the draft vocabulary adds no CE:
    the draft cannot name it; its mass still counts against q in the L1 term)."""
    w, weight_sum, norm = _weighting(logits, valid, decay, normalizer)
    log_q = F.log_softmax(logits.float(), -1)
    draft_labels = labels if target_to_draft is None else target_to_draft[labels.clamp_min(0)]
    nameable = draft_labels >= 0
    ce = -log_q.gather(-1, draft_labels.clamp_min(0)[..., None]).squeeze(-1) * nameable
    ce_term = (ce * w).sum() / norm

    l1 = topk_l1_distance(log_q, teacher, target_to_draft)
    return _combine(ce_term, l1, w, norm, weight_sum, confidence_logits, weights)


def greedy_accepts(logits: torch.Tensor, teacher: TopKTeacher, draft_to_target: torch.Tensor | None) -> torch.Tensor:
    """Whether the draft's argmax (mapped to a target id) is the target's argmax, (..., γ): the
    acceptance of each position at T = 0, teacher-forced."""
    choice = logits.argmax(-1)
    if draft_to_target is not None:
        choice = draft_to_target[choice]
    return choice == teacher.argmax


#: the largest fp32 (…, γ, V) temporary one chunk of the loss may make (glibc's heap serves it below 32 MB;
#: above, every step pays fresh page faults for it: see dspark/drafters/block_attention.py)
LOSS_CHUNK_BYTES = 16 * 2**20


def chunked_block_loss(loss_fn, logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                       confidence_logits: torch.Tensor | None, decay: float, normalizer, *, teacher=None,
                       chunk_bytes: int = LOSS_CHUNK_BYTES, **kwargs) -> LossOutput:
    """`loss_fn` (block_loss / topk_block_loss) over chunks of the anchor dim (logits (B, A, γ, V)), summed:
    every term is Σ w·ℓ / normaliser with one normaliser for the whole batch, so the sum of the chunks'
    terms is the whole batch's, while each chunk's fp32 softmax temporaries stay small. `teacher` is the
    (B, A, γ, …) target side: a TopKTeacher, or the full target logits (passed positionally)."""
    batch, anchors = logits.shape[:2]
    per_anchor = batch * logits.shape[2] * logits.shape[3] * 4
    step = max(1, chunk_bytes // max(per_anchor, 1))
    if normalizer is None:
        normalizer = _weighting(logits, valid, decay, None)[2]
    parts = []
    for first in range(0, anchors, step):
        rows = slice(first, min(first + step, anchors))
        side = teacher.select((slice(None), rows)) if isinstance(teacher, TopKTeacher) else teacher[:, rows]
        parts.append(loss_fn(logits[:, rows], side, labels[:, rows], valid[:, rows],
                             None if confidence_logits is None else confidence_logits[:, rows],
                             decay=decay, normalizer=normalizer, **kwargs))
    if len(parts) == 1:
        return parts[0]
    total = lambda name: sum(getattr(part, name) for part in parts)  # noqa: E731
    return LossOutput(total("total"), total("ce"), total("tv"), total("conf"), total("accept"),
                      total("weight_sum"), torch.cat([part.soft_label for part in parts], 1))
