"""The small heads that sit on top of the DSpark parallel backbone.

Sequential heads add a bias to the backbone's base logits U_k that depends on the draft tokens sampled
earlier in the block, so a block stops mixing modes ("of problem"). They are stepped left to right,
one position at a time, with the same `step` function at training time (teacher-forced) and at
inference time (sampled), so the two paths cannot drift apart. Parameter names follow DeepSpec.

With a reduced draft vocabulary (`dspark.drafters.vocab`) W2 produces a bias over the Vd draft ids only,
while W1 stays (V, r): the previous token (the anchor, or a drafted token mapped back) is a target id.
"""

import torch
from torch import nn

#: markov_head_type values of DeepSpec checkpoints; None means no sequential head (DFlash).
HEAD_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """First-order transition bias B(x_{k-1}, .) = W2ᵀ W1[x_{k-1}] with a rank-r factorisation.

    W1 is indexed by target ids (vocab_size rows); W2 outputs `output_size` logits (the draft
    vocabulary; default vocab_size)."""

    head_type = "vanilla"

    def __init__(self, vocab_size: int, rank: int, output_size: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, output_size or vocab_size, bias=False)

    def prev_embedding(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: also an input of the confidence head."""
        return self.markov_w1(prev_tokens)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Recurrent state before the first block position; memoryless heads have none."""
        return None

    def step(
        self, state: torch.Tensor | None, prev_tokens: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bias (..., Vd) for one block position given the previous token (...,) and h_k (..., D)."""
        return self.markov_w2(self.prev_embedding(prev_tokens)), state


class GatedMarkovHead(MarkovHead):
    """Markov head whose token embedding is gated by the backbone hidden: W2ᵀ(σ(W_g[h; e]) ⊙ e)."""

    head_type = "gated"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, output_size: int | None = None) -> None:
        super().__init__(vocab_size, rank, output_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, state, prev_tokens, hidden):
        embedding = self.prev_embedding(prev_tokens)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedding], -1)))
        return self.markov_w2(gate * embedding), state


class RNNHead(MarkovHead):
    """Gated recurrent head: the state s_k carries the whole block prefix, not just x_{k-1}.

    z_k = [s_{k-1}; W1[x_{k-1}]; h_k]; one linear map gives gate g, candidate c and output o;
    s_k = σ(g)⊙s_{k-1} + (1-σ(g))⊙tanh(c); bias = W2ᵀ tanh(o); s_0 = 0.
    """

    head_type = "rnn"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, output_size: int | None = None) -> None:
        super().__init__(vocab_size, rank, output_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros(*hidden.shape[:-1], self.rank)

    def step(self, state, prev_tokens, hidden):
        z = torch.cat([state, self.prev_embedding(prev_tokens), hidden], -1)
        gate, candidate, output = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state


def build_sequential_head(
    head_type: str | None, vocab_size: int, rank: int, hidden_size: int, output_size: int | None = None
) -> MarkovHead | None:
    """The sequential head of `head_type`; `output_size` is the draft vocabulary (default vocab_size)."""
    if head_type is None:
        return None
    if head_type == "vanilla":
        return MarkovHead(vocab_size, rank, output_size)
    if head_type == "gated":
        return GatedMarkovHead(vocab_size, rank, hidden_size, output_size)
    if head_type == "rnn":
        return RNNHead(vocab_size, rank, hidden_size, output_size)
    raise ValueError(f"markov_head_type must be one of {HEAD_TYPES} or None, got {head_type!r}")


def sequential_logits(
    head: MarkovHead | None, base_logits: torch.Tensor, hidden: torch.Tensor, prev_tokens: torch.Tensor
) -> torch.Tensor:
    """Teacher-forced logits U_k + B_k for a whole block: base_logits (..., γ, Vd), hidden (..., γ, D),
    prev_tokens (..., γ) = [x_0, x_1, .., x_{γ-1}] (target ids). Loops over γ exactly as sampling does;
    a memoryless head (Markov, gated) takes every position in one call of the same `step` (slicing the
    (..., γ, Vd) logits per position would make the backward allocate γ full-size zero tensors)."""
    if head is None:
        return base_logits
    state = head.initial_state(hidden[..., 0, :])
    if state is None:
        bias, _ = head.step(None, prev_tokens, hidden)
        return base_logits + bias
    logits = []
    for k in range(base_logits.shape[-2]):
        bias, state = head.step(state, prev_tokens[..., k], hidden[..., k, :])
        logits.append(base_logits[..., k, :] + bias)
    return torch.stack(logits, -2)


class ConfidenceHead(nn.Module):
    """Logit of c_k = σ(wᵀ[h_k ; W1[x_{k-1}]]), the chance x_k survives given x_1..x_{k-1} did.

    Without a Markov head (or with `with_markov` off) the input is h_k alone.
    """

    def __init__(self, hidden_size: int, markov_rank: int = 0) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor | None = None) -> torch.Tensor:
        features = hidden if prev_embedding is None else torch.cat([hidden, prev_embedding], -1)
        return self.proj(features).squeeze(-1)
