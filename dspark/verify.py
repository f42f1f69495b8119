"""Verification of one draft block against the target: accepted / recovered / bonus tokens.

Standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft
token x_k with probability min(1, p_k(x_k) / q_k(x_k)); at the first rejection emit a *recovered*
token from norm(max(p_k - q_k, 0)); if every draft is accepted emit a *bonus* token from p_{l+1}.
The emitted sequence is then distributed exactly as sampling from p token by token.
"""

from dataclasses import dataclass

import torch

from dspark.sampling import SamplingParams, probabilities, sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int
    next_token: int  # the recovered token after a rejection, or the bonus token after full acceptance


def emitted_tokens(draft_tokens: torch.Tensor, verdict: Verdict) -> list[int]:
    return draft_tokens[: verdict.num_accepted].tolist() + [verdict.next_token]


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Accept while the draft equals the target's argmax; then emit the target's argmax."""
    target_choice = target_logits.argmax(-1)
    num_drafts = draft_tokens.shape[0]
    matches = (draft_tokens == target_choice[:num_drafts]).long()
    num_accepted = int(matches.cumprod(0).sum()) if num_drafts else 0
    return Verdict(num_accepted, int(target_choice[num_accepted]))


def verify_sampled(
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Rejection sampling with processed probabilities p (l+1, V) and q (l, V).

    `q=None` means a deterministic draft (n-gram lookup): q is one-hot on the draft token, so a
    draft is accepted with probability p(x) and the residual is p with x removed.
    """
    num_drafts = draft_tokens.shape[0]
    rows = torch.arange(num_drafts)
    p_draft = p[rows, draft_tokens]
    q_draft = q[rows, draft_tokens] if q is not None else torch.ones_like(p_draft)
    uniforms = torch.rand(num_drafts, generator=generator)
    accepted = uniforms * q_draft < p_draft
    rejected = (~accepted).nonzero()
    if rejected.numel() == 0:
        return Verdict(num_drafts, int(sample(p[num_drafts], generator)))
    k = int(rejected[0])
    if q is not None:
        residual = (p[k] - q[k]).clamp_min(0.0)
    else:
        residual = p[k].clone()
        residual[draft_tokens[k]] = 0.0
    if float(residual.sum()) <= 0.0:  # only reachable through float round-off when p == q
        residual = p[k]
    return Verdict(k, int(sample(residual / residual.sum(), generator)))


def verify(
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """Verify `draft_tokens` (l,) against raw target logits (l+1, V) for the given sampling params."""
    if params.greedy:
        return verify_greedy(draft_tokens, target_logits)
    return verify_sampled(draft_tokens, q, probabilities(target_logits, params), generator)
