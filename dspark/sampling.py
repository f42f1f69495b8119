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
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


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
