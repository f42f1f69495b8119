"""Prompt lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the
context's suffix. Free to run and strong on code and on answers that quote the prompt."""

import torch

from dspark.drafters.base import Draft, Drafter
from dspark.sampling import SamplingParams


def ngram_lookup(context: torch.Tensor, num_tokens: int, max_ngram: int, min_ngram: int) -> torch.Tensor:
    """Longest suffix n-gram (max_ngram down to min_ngram) that occurred earlier: the tokens after
    its most recent earlier occurrence, at most `num_tokens` of them."""
    length = context.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = context[length - n :]
        windows = context[: length - 1].unfold(0, n, 1)  # every n-gram that ends before the last token
        hits = (windows == suffix).all(-1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return context[start : start + num_tokens]
    return context[:0]


class NgramDrafter(Drafter):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_block_size: int | None = 10) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_block_size = max_block_size

    def drafts_for_free(self, state, context: torch.Tensor) -> bool:
        return True

    def propose(self, state, context, num_tokens, sampling: SamplingParams, generator) -> Draft:
        return Draft(ngram_lookup(context, num_tokens, self.max_ngram, self.min_ngram).clone())
