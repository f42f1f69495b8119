"""EAGLE-3 baseline drafter (Li et al. 2025): one autoregressive decoder layer on fused target features.

Step 1 of a draft pairs fc([low; mid; high] target features of position t) with the embedding of token
t+1 and predicts token t+2 (EAGLE/MTP alignment). The layer's attention reads the concatenation
[input_layernorm(embed); hidden_norm(hidden)] (2·D wide) and its residual stream is the hidden input.
Steps j > 1 feed the layer's own output hidden state back in place of the target feature, paired with
the previous draft token ("training-time test", TTT, unrolled the same way in `forward`).

So the anchor (last committed token, whose own feature the target has not computed yet) pairs with the
feature of the position before it. Per request we keep the layer's K/V of every committed pair
(feature_s, token_{s+1}); each round appends the pairs completed since the last one, and draft steps
append temporary K/V that are dropped afterwards. RoPE position of step j at position t is t + j - 1
both here and in training (EAGLE-3's own trainer keeps t for every step, but drafts at increasing
positions), so the training forward and the inference path compute the same function.

The Llama building blocks (attention, K/V cache, TTT attention) live in `dspark.drafters.layers`; the
config, target glue and checkpoint I/O shared with the MTP drafter in `dspark.drafters.baseline`.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dspark.drafters.base import Draft
from dspark.drafters.baseline import BaselineDrafter, BaselineModel, DraftLayerConfig, save_checkpoint
from dspark.drafters.layers import Attend, DecoderLayer, KVCache, RMSNorm, TTTAttend, init_weights, shift_left
from dspark.sampling import SamplingParams


@dataclass
class Eagle3Config(DraftLayerConfig):
    @staticmethod
    def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
        """Low / mid / high = (1, L//2 - 1, L - 4), as EAGLE-3 / SpecForge pick them."""
        last = num_target_layers - 1
        return tuple(min(max(i, -1), last) for i in (1, num_target_layers // 2 - 1, num_target_layers - 4))


# -- EAGLE-3 -----------------------------------------------------------------------------------


class Eagle3Layer(DecoderLayer):
    """The EAGLE-3 midlayer: attention reads [input_layernorm(embed); hidden_norm(hidden)]."""

    def __init__(self, config: DraftLayerConfig) -> None:
        super().__init__(config, 2 * config.hidden_size)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        return self.block(x, hidden, positions, attend)


class Eagle3Model(BaselineModel, nn.Module):
    """fc (F -> D), one midlayer, own final norm; the target's embedding and LM head.
    Parameter names follow the EAGLE-3 checkpoints (fc, midlayer.*, norm)."""

    config_cls, drafter_type = Eagle3Config, "eagle3"

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._shared = (embed_tokens, lm_head)
        self.init_draft_vocab()
        init_weights(self)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """fc([low; mid; high]) of target features (..., F)."""
        return self.fc(features.to(self.dtype))

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             attend: Attend) -> torch.Tensor:
        """One draft step: tokens (B, T) with their paired hidden (B, T, D) -> output hidden (B, T, D)."""
        return self.midlayer(self.embed(input_ids), hidden, positions, attend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(
        self, features: torch.Tensor, input_ids: torch.Tensor, num_steps: int | None = None
    ) -> list[torch.Tensor]:
        """Training-time test over whole sequences: features (B, T, F) and input_ids (B, T) of the same
        positions. Returns one (B, T, V) logits per step; logits[j][:, t] predicts input_ids[:, t+j+2]
        (valid while t + j + 2 < T). Step j > 0 feeds back step j-1's hidden and token t+j+1."""
        num_steps = num_steps or self.config.num_speculative_tokens
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden, attend, logits = self.fuse(features), TTTAttend(), []
        for j in range(num_steps):
            hidden = self.step(shift_left(input_ids, j + 1), hidden, positions + j, attend)
            logits.append(self.logits(hidden))
        return logits

    def save_pretrained(self, directory: str | Path) -> None:
        aux_ids = [i + 1 for i in self.config.target_layer_ids]  # vLLM counts inputs of layers, not outputs
        extra = {"model_type": "llama", "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids}}
        save_checkpoint(self, directory, "Eagle3LlamaForCausalLM", "eagle3", extra)


@dataclass
class Eagle3State:
    """Per request: the layer's K/V of every committed pair (feature_s, token_{s+1}); the target features
    of later positions, waiting for their next token; the output hidden at the newest cached pair."""

    cache: KVCache
    features: torch.Tensor
    hidden: torch.Tensor | None = None


class Eagle3Drafter(BaselineDrafter):
    model_cls = Eagle3Model

    def __init__(self, model: Eagle3Model) -> None:
        super().__init__(model)
        self.max_block_size = None  # autoregressive: any length, though trained for num_speculative_tokens

    @torch.inference_mode()
    def start(self, prompt_ids: torch.Tensor, prompt_hidden: torch.Tensor | None) -> Eagle3State:
        state = Eagle3State(KVCache(), self.checked(prompt_hidden)[:0])
        self.commit(state, prompt_hidden)
        return state

    @torch.inference_mode()
    def commit(self, state: Eagle3State, committed_hidden: torch.Tensor | None) -> None:
        state.features = torch.cat([state.features, self.checked(committed_hidden)])

    @torch.inference_mode()
    def propose(self, state: Eagle3State, context: torch.Tensor, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if num_tokens <= 0:
            return Draft.empty(self.model.device)
        hidden = self._absorb(state, context)
        committed, position = state.cache.length, context.shape[0] - 2
        tokens, q = [], []
        for j in range(num_tokens):
            if j:
                step_position = torch.tensor([position + j], device=hidden.device)
                hidden = self.model.step(tokens[-1].view(1, 1), hidden, step_position, state.cache.attend)
            token, probs = self.draw(self.model.logits(hidden)[0, -1], sampling, generator)
            tokens.append(token)
            q.append(probs)
        state.cache.crop(committed)  # drop the draft steps' K/V
        return Draft(torch.stack(tokens), torch.stack(q))

    def _absorb(self, state: Eagle3State, context: torch.Tensor) -> torch.Tensor:
        """Cache the pairs completed since the last round: the waiting features with their now-known
        next tokens (the last pair holds the anchor). Returns the output hidden (1, 1, D) of that pair."""
        start = state.cache.length
        end = start + state.features.shape[0]
        self.check_feature_count(end, context.shape[0])
        if end > start:
            tokens = context[start + 1 : end + 1].to(self.model.device)[None]
            positions = torch.arange(start, end, device=tokens.device)
            out = self.model.step(tokens, self.model.fuse(state.features[None]), positions, state.cache.attend)
            state.hidden, state.features = out[:, -1:], state.features[:0]
        return state.hidden

