"""DeepSeek-V3 multi-token prediction (MTP) baseline drafter.

Depth k (1-based) at position s: h^k_s = Layer_k(W_proj [enorm(embed(x_{s+k})); hnorm(h^{k-1}_s)]) and
logits lm_head(norm_k(h^k_s)) predict x_{s+k+1}; h^0 is the target's last hidden state (DeepSpec id
L-1). Each depth is a causal sequence over positions, exactly as DeepSeek-V3 trains it (`forward`).
MTP-k has k modules; deeper depths reuse the last module.

Drafting from the anchor at position n-1 (features known up to n-2) takes depth k at position n-2,
whose output predicts draft k. Per request each depth keeps its own K/V of the committed positions
(those whose input token x_{s+k} is committed) plus its committed outputs that the next depth has not
consumed yet. A round computes each depth over the positions committed since the last round plus the
few that involve this round's drafts (dropped afterwards), so inference computes exactly the training
function without ever recomputing the context.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dspark.drafters.base import Draft
from dspark.drafters.baseline import BaselineDrafter, BaselineModel, DraftLayerConfig, save_checkpoint
from dspark.drafters.layers import Attend, DecoderLayer, KVCache, RMSNorm, causal_attend, init_weights, shift_left
from dspark.sampling import SamplingParams


@dataclass
class MTPConfig(DraftLayerConfig):
    #: most draft tokens (depths) per round; MTP-1 by default, as the paper's production baseline.
    num_speculative_tokens: int = 1
    #: distinct MTP modules; depths beyond the last reuse it.
    num_modules: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_modules < 1:
            raise ValueError(f"num_modules must be >= 1, got {self.num_modules}")

    @staticmethod
    def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
        """The target's last layer (HF reports it after the target's final norm)."""
        return (num_target_layers - 1,)


class MTPModule(nn.Module):
    """One DeepSeek-V3 MTP module (parameter names as in its checkpoints)."""

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPModel(BaselineModel, nn.Module):
    config_cls, drafter_type = MTPConfig, "mtp"

    def __init__(self, config: MTPConfig, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(MTPModule(config) for _ in range(config.num_modules))
        self._shared = (embed_tokens, lm_head)
        self.init_draft_vocab()
        init_weights(self)

    def module(self, depth: int) -> MTPModule:
        """Module of 0-based `depth`: the last one is reused beyond num_modules."""
        return self.layers[min(depth, len(self.layers) - 1)]

    def step(self, depth: int, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             attend: Attend) -> torch.Tensor:
        """Depth `depth` (0-based) over tokens (B, T) x_{s+depth+1} and inputs (B, T, D) h^depth_s."""
        module = self.module(depth)
        x = torch.cat([module.enorm(self.embed(input_ids)), module.hnorm(hidden.to(self.dtype))], -1)
        return module.layer(module.eh_proj(x), positions, attend)

    def logits(self, depth: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.module(depth).norm(hidden))

    def forward(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, num_depths: int | None = None
    ) -> list[torch.Tensor]:
        """Teacher forcing over whole sequences: target last hidden states (B, T, D) and input_ids (B, T)
        of the same positions. Returns one (B, T, V) logits per depth; logits[d][:, t] predicts
        input_ids[:, t+d+2] (valid while t + d + 2 < T)."""
        num_depths = num_depths or self.config.num_speculative_tokens
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        logits = []
        for depth in range(num_depths):
            hidden = self.step(depth, shift_left(input_ids, depth + 1), hidden, positions, causal_attend)
            logits.append(self.logits(depth, hidden))
        return logits

    def save_pretrained(self, directory: str | Path) -> None:
        save_checkpoint(self, directory, "DSparkMTPModel", "mtp", {"model_type": "dspark_mtp"})


@dataclass
class MTPState:
    """Per request and 0-based depth d: caches[d] holds depth d's K/V of positions [0, caches[d].length);
    inputs[d] holds depth d's inputs h^d at the committed positions from caches[d].length on that it has
    not run yet (target features for d = 0, depth d-1's committed outputs otherwise)."""

    caches: list[KVCache]
    inputs: list[torch.Tensor]


class MTPDrafter(BaselineDrafter):
    model_cls = MTPModel

    def __init__(self, model: MTPModel) -> None:
        super().__init__(model)
        self.max_block_size = model.config.num_speculative_tokens

    @torch.inference_mode()
    def start(self, prompt_ids: torch.Tensor, prompt_hidden: torch.Tensor | None) -> MTPState:
        features = self.checked(prompt_hidden)
        depths = self.config.num_speculative_tokens
        return MTPState([KVCache() for _ in range(depths)], [features] + [features[:0]] * (depths - 1))

    @torch.inference_mode()
    def commit(self, state: MTPState, committed_hidden: torch.Tensor | None) -> None:
        features = self.checked(committed_hidden)
        state.inputs[0] = torch.cat([state.inputs[0], features])

    @torch.inference_mode()
    def propose(self, state: MTPState, context: torch.Tensor, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        num_tokens = min(num_tokens, self.max_block_size)
        if num_tokens <= 0:
            return Draft.empty(self.model.device)
        length = context.shape[0]  # the anchor sits at length - 1; features cover positions < length - 1
        self.check_feature_count(state.caches[0].length + state.inputs[0].shape[0], length)
        sequence = context.to(self.model.device)
        tokens, q, previous = [], [], None  # previous: depth d-1's outputs of this round
        for depth in range(len(state.caches)):
            cache, start = state.caches[depth], state.caches[depth].length
            hidden = state.inputs[depth] if previous is None else torch.cat([state.inputs[depth], previous])
            previous = None
            if depth < num_tokens:  # run positions [start, length - 1): inputs x_{s+depth+1}, drafts included
                positions = torch.arange(start, length - 1, device=sequence.device)
                ids = sequence[start + depth + 1 : length + depth][None]
                previous = self.model.step(depth, ids, hidden[None], positions, cache.attend)[0]
                token, probs = self.draw(self.model.logits(depth, previous[-1]), sampling, generator)
                tokens.append(token)
                q.append(probs)
                sequence = torch.cat([sequence, tokens[-1][None]])
                cache.crop(max(start, length - 1 - depth))  # keep positions whose input token is committed
            ready = length - 1 if depth == 0 else state.caches[depth - 1].length
            state.inputs[depth] = hidden[cache.length - start : ready - start]
            if previous is None:
                break  # deeper depths are untouched this round
        return Draft(torch.stack(tokens), torch.stack(q))
