"""Classic speculative decoding with a separate, smaller causal LM that shares the target's tokenizer."""

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from dspark.drafters.base import Draft, Drafter
from dspark.sampling import SamplingParams, probabilities, sample
from dspark.target import Target


@dataclass
class DraftLMState:
    runner: Target
    cached: list[int] = field(default_factory=list)  # tokens whose K/V sit in the draft cache


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftLMDrafter(Drafter):
    def __init__(self, model: PreTrainedModel, max_block_size: int | None = None) -> None:
        self.model = model.eval()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_block_size = max_block_size

    def start(self, prompt_ids: torch.Tensor, prompt_hidden: torch.Tensor | None) -> DraftLMState:
        return DraftLMState(Target(self.model))

    def _sync(self, state: DraftLMState, context: list[int]) -> torch.Tensor:
        """Drop rejected drafts from the draft cache, feed the committed tokens it has not seen;
        returns the logits for the token after the anchor."""
        keep = min(common_prefix_length(state.cached, context), len(context) - 1)
        if state.runner.cache is None:
            keep = 0
            state.runner.reset()
        state.runner.rollback(keep)
        state.cached = context[:]
        return state.runner.extend(torch.tensor(context[keep:]), last_logits_only=True).logits[-1]

    @torch.inference_mode()
    def propose(self, state: DraftLMState, context: torch.Tensor, num_tokens: int,
                sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        if num_tokens <= 0:
            return Draft.empty()
        logits = self._sync(state, context.tolist())
        tokens, q = [], []
        for step in range(num_tokens):
            probs = probabilities(logits, sampling)
            token = int(sample(probs, generator)) if not sampling.greedy else int(logits.argmax())
            tokens.append(token)
            q.append(probs)
            if step + 1 < num_tokens:
                logits = state.runner.extend(torch.tensor([token]), last_logits_only=True).logits[-1]
                state.cached.append(token)
        return Draft(torch.tensor(tokens), torch.stack(q))
