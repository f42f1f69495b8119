"""Logit processing shared by target and draft.

Losslessness needs p and q to be processed by the *same* function: a draft sampled from a
differently truncated distribution than the one handed to the verifier silently biases the output.
"""

from dataclasses import dataclass

import torch

from dspark.errors import DsparkError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable truncation."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise DsparkError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise DsparkError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DsparkError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of `logits` (..., V) after temperature, top-k and top-p; float32.

    For greedy params this is the one-hot of the argmax, so callers can treat both modes alike.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(_outside_nucleus(logits, params.top_p), float("-inf"))
    return logits.softmax(-1)


NUCLEUS_CANDIDATES = 256


def _outside_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """True where a token lies outside the top-p nucleus (the smallest prefix of the sorted
    distribution whose mass reaches top_p; a token is dropped when the mass before it is >= top_p).

    A full sort of a 49k vocabulary per row dominates a batched sampling step on a CPU, so the nucleus
    is first looked for among the top NUCLEUS_CANDIDATES tokens; when their mass reaches top_p in every
    row, everything outside is dropped by the same rule, so the result equals the full sort's (up to
    the order of exactly tied logits). Otherwise the full sort decides."""
    vocab = logits.shape[-1]
    if NUCLEUS_CANDIDATES < vocab:
        top_probs, order = torch.topk(logits.softmax(-1), NUCLEUS_CANDIDATES, dim=-1)
        if bool((top_probs.sum(-1) >= top_p).all()):
            drop_top = top_probs.cumsum(-1) - top_probs >= top_p
            drop = torch.ones_like(logits, dtype=torch.bool)
            return drop.scatter(-1, order, drop_top)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `logits` (R, V), distributed exactly as `sample(probabilities(logits, params))`.

    For batched generation (self-distillation) the full-vocabulary multinomial and masking cost more
    than the model's forward on a CPU; with top-p and no top-k the nucleus is almost always inside a
    short list of candidates, so the draw is made there. Falls back to the full path otherwise."""
    if params.greedy:
        return logits.argmax(-1)
    if params.top_k == 0 and params.top_p < 1.0 and NUCLEUS_CANDIDATES < logits.shape[-1]:
        probs = (logits.float() / params.temperature).softmax(-1)
        top_probs, order = torch.topk(probs, NUCLEUS_CANDIDATES, dim=-1)
        if bool((top_probs.sum(-1) >= params.top_p).all()):
            keep = top_probs.cumsum(-1) - top_probs < params.top_p
            choice = torch.multinomial(top_probs * keep, 1, generator=generator)
            return order.gather(-1, choice).squeeze(-1)
    return sample(probabilities(logits, params), generator)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` (..., V), drawn with the request's own generator."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample (or argmax) one token from a single row of target logits."""
    if params.greedy:
        return int(logits.argmax(-1))
    return int(sample(probabilities(logits, params), generator))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator; never the global RNG, so concurrent requests stay reproducible."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
