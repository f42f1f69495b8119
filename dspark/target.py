"""Adapter around any Hugging Face causal LM, batch size 1: prefill, extend by k tokens (logits of
every new position + hidden states of chosen layers), roll the KV cache back to any length.

Rollback is a crop of the HF `DynamicCache`; rejected draft positions are simply dropped.
"""

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass
class TargetOutput:
    """What one forward returns for one segment."""

    logits: torch.Tensor  # (k, V) float32, one row per new position (or only the last on prefill)
    hidden: torch.Tensor | None  # (k, len(layer_ids) * D) concatenated features, or None


def hf_hidden_index(layer_id: int) -> int:
    """DeepSpec layer id (L = output of layer L, -1 = embeddings) -> index into HF `hidden_states`."""
    return layer_id + 1


def cache_kwarg(model: PreTrainedModel) -> str:
    """The name `model.forward` takes its KV cache by (transformers renamed `past_key_values` to `cache`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Target:
    """One sequence's forward over an HF model with its own KV cache (the batch-1 adapter); the engine
    runs it through `SerialBackend`, drafters use it for their own models."""

    def __init__(self, model: PreTrainedModel, layer_ids: tuple[int, ...] = ()) -> None:
        self.model = model.eval()
        self.config = model.config
        self.layer_ids = tuple(layer_ids)
        num_layers = self.num_layers
        for layer_id in self.layer_ids:
            if not -1 <= layer_id < num_layers:
                raise ValueError(f"target layer id {layer_id} outside [-1, {num_layers - 1}]")
        self.cache: DynamicCache | None = None
        self.length = 0
        self._cache_kwarg = cache_kwarg(model)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def num_layers(self) -> int:
        text_config = self.config.get_text_config()
        return int(text_config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.get_text_config().hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.config)
        self.length = 0

    @torch.inference_mode()
    def extend(self, token_ids: torch.Tensor, last_logits_only: bool = False) -> TargetOutput:
        """Run `token_ids` (k,) after the cached context; the cache grows by k."""
        if self.cache is None:
            self.reset()
        outputs = self.model(
            input_ids=token_ids.to(self.device)[None],
            **{self._cache_kwarg: self.cache},
            use_cache=True,
            output_hidden_states=bool(self.layer_ids),
            logits_to_keep=1 if last_logits_only else 0,
        )
        self.cache = getattr(outputs, "cache", None) or outputs.past_key_values
        self.length += int(token_ids.shape[0])
        hidden = None
        if self.layer_ids:
            hidden = torch.cat([outputs.hidden_states[hf_hidden_index(i)][0] for i in self.layer_ids], -1)
        return TargetOutput(outputs.logits[0].float(), hidden)

    def prefill(self, prompt_ids: torch.Tensor) -> TargetOutput:
        """Fresh cache holding the prompt; logits of the last position only."""
        self.reset()
        return self.extend(prompt_ids, last_logits_only=True)

    def rollback(self, length: int) -> None:
        """Keep the first `length` cached positions; drop the rest (rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        if length < self.length:
            self.cache.crop(length - self.length)  # negative = number of positions to drop
            self.length = length


class SerialBackend:
    """The engine's backend over batch-1 targets (`Target`, or any object with `extend` / `rollback` /
    `length`), one per slot: a forward runs its segments one after another. The fallback for architectures the
    ragged forward does not cover, and the path for custom targets."""

    def __init__(self, targets: list) -> None:
        if not targets:
            raise ValueError("SerialBackend needs at least one target")
        self.targets = list(targets)
        self.layer_ids = tuple(getattr(targets[0], "layer_ids", ()))
        self.max_slots = len(self.targets)
        self.free = list(range(self.max_slots))[::-1]

    @classmethod
    def for_model(cls, model: PreTrainedModel, layer_ids: tuple[int, ...] = (), max_slots: int = 1) -> "SerialBackend":
        return cls([Target(model, layer_ids) for _ in range(max_slots)])

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError(f"all {self.max_slots} slots are in use")
        slot = self.free.pop()
        target = self.targets[slot]
        if hasattr(target, "reset"):
            target.reset()
        else:
            target.rollback(0)
        return slot

    def release(self, slot: int) -> None:
        target = self.targets[slot]
        if getattr(target, "cache", None) is not None:
            target.cache = None  # free the KV memory now, not at the next allocate
            target.length = 0
        if slot not in self.free:
            self.free.append(slot)

    def length(self, slot: int) -> int:
        return self.targets[slot].length

    def rollback(self, slot: int, length: int) -> None:
        self.targets[slot].rollback(length)

    def forward(self, segments) -> list[TargetOutput]:
        outputs = []
        for segment in segments:
            output = self.targets[segment.slot].extend(segment.token_ids, last_logits_only=segment.logits != "all")
            if segment.logits != "all":
                output = TargetOutput(output.logits[-1:] if segment.logits == "last" else output.logits[:0],
                                      output.hidden)
            outputs.append(output)
        return outputs
