"""A Markov-chain target with an exactly computable output distribution, for statistical tests."""

import torch
from scipy.stats import chisquare

from dspark.drafters.base import Draft, Drafter
from dspark.generation import speculative_decode
from dspark.sampling import SamplingParams, probabilities, sample
from dspark.target import TargetOutput


class MarkovTarget:
    """Next-token logits depend only on the current token: logits(x_t) = table[x_t]."""

    layer_ids: tuple[int, ...] = ()

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.length = 0

    def prefill(self, prompt_ids: torch.Tensor) -> TargetOutput:
        self.length = int(prompt_ids.shape[0])
        return TargetOutput(self.table[prompt_ids[-1:]], None)

    def extend(self, token_ids: torch.Tensor, last_logits_only: bool = False) -> TargetOutput:
        self.length += int(token_ids.shape[0])
        return TargetOutput(self.table[token_ids], None)

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length


class MarkovDrafter(Drafter):
    """Samples each draft from its own (different) chain, returning the q it sampled from."""

    def __init__(self, table: torch.Tensor, confidence: float | None = None) -> None:
        self.table = table
        self.confidence = confidence

    def propose(self, state, context, num_tokens, sampling: SamplingParams, generator) -> Draft:
        previous = int(context[-1])
        tokens, q = [], []
        for _ in range(num_tokens):
            probs = probabilities(self.table[previous], sampling)
            previous = int(sample(probs, generator)) if not sampling.greedy else int(probs.argmax())
            tokens.append(previous)
            q.append(probs)
        if not tokens:
            return Draft.empty()
        return Draft(torch.tensor(tokens), torch.stack(q))


def random_tables(vocab: int, seed: int, draft_noise: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(vocab, vocab, generator=generator) * 1.5
    draft = target + torch.randn(vocab, vocab, generator=generator) * draft_noise
    return target, draft


def exact_marginals(table: torch.Tensor, first_context_token: int, params: SamplingParams, steps: int) -> list:
    transition = probabilities(table, params)
    marginal = transition[first_context_token]
    marginals = [marginal]
    for _ in range(steps - 1):
        marginal = marginal @ transition
        marginals.append(marginal)
    return marginals


def sample_outputs(target_table, drafter, params, num_samples, num_tokens, block_size, seed=0):
    """num_samples generations of num_tokens tokens each, as a (num_samples, num_tokens) tensor."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.tensor([0])
    outputs = torch.empty(num_samples, num_tokens, dtype=torch.long)
    for i in range(num_samples):
        target = MarkovTarget(target_table)
        chunks = speculative_decode(target, drafter, prompt, max_new_tokens=num_tokens, sampling=params,
                                    generator=generator, block_size=block_size)
        outputs[i] = torch.tensor([t for chunk in chunks for t in chunk])
    return outputs


def chi_square_pvalue(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square goodness of fit; bins with expected count < 5 are pooled into one."""
    n = samples.shape[0]
    counts = torch.bincount(samples, minlength=expected.shape[0]).double()
    expected_counts = expected.double() * n
    big = expected_counts >= 5
    observed = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    wanted = torch.cat([expected_counts[big], expected_counts[~big].sum(0, keepdim=True)])
    if wanted[-1] == 0:
        if observed[-1] > 0:
            return 0.0  # emitted a token the target can never produce
        observed, wanted = observed[:-1], wanted[:-1]
    wanted = wanted * observed.sum() / wanted.sum()
    return float(chisquare(observed.numpy(), wanted.numpy()).pvalue)


def position_pvalues(target_table, drafter, params, num_samples, num_tokens=4, block_size=4, seed=0) -> list:
    outputs = sample_outputs(target_table, drafter, params, num_samples, num_tokens, block_size, seed)
    marginals = exact_marginals(target_table, 0, params, num_tokens)
    return [chi_square_pvalue(outputs[:, j], marginals[j]) for j in range(num_tokens)]
