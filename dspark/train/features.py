"""Online target features: one frozen, gradient-free target forward per training batch.

It gives the drafter's context features (hidden states of `target_layer_ids`, concatenated) and the
target's logits at the block positions only: the final hidden state is gathered at those rows before
the LM head, so the (B, T, V) logits of the whole sequence are never materialised.
"""

import torch
from torch import nn
from transformers import PreTrainedModel

from dspark.target import hf_hidden_index


class TargetFeatures:
    def __init__(self, model: PreTrainedModel, layer_ids: tuple[int, ...]) -> None:
        self.model = model.eval().requires_grad_(False)
        self.layer_ids = tuple(layer_ids)
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, model.base_model_prefix)
        self.lm_head: nn.Module = model.get_output_embeddings()
        text_config = model.config.get_text_config()
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        num_layers = int(text_config.num_hidden_layers)
        bad = [i for i in self.layer_ids if not -1 <= i < num_layers]
        if bad or not self.layer_ids:
            raise ValueError(f"target layer ids {self.layer_ids} do not fit a {num_layers}-layer target")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits (float32) for final hidden states (..., D), as its own forward computes them."""
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()  # not inference_mode: the features enter the drafter's autograd graph
    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids / attention_mask (B, T), right-padded; positions (B, ...) where target logits are
        wanted. Returns features (B, T, len(layer_ids) * D) and logits (B, ..., V) float32 (or None)."""
        outputs = self.decoder(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )
        hidden_states = outputs.hidden_states
        features = torch.cat([hidden_states[hf_hidden_index(i)] for i in self.layer_ids], -1)
        logits = None
        if positions is not None:
            last = outputs.last_hidden_state
            rows = last.gather(1, positions.flatten(1)[..., None].expand(-1, -1, last.shape[-1]))
            logits = self.logits(rows).view(*positions.shape, -1)
        return features, logits
