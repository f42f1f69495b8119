"""What the EAGLE-3 and MTP baseline drafters share beyond their layers (`dspark.drafters.layers`): the
draft layer config, the target's frozen embedding and LM head, checkpoint save/load, drafting helpers and
the model and drafter bases (`BaselineModel`, `BaselineDrafter`) they build on.

Their checkpoints are config.json (DeepSpec/vLLM style + a `dspark` field naming the drafter type) and
model.safetensors with only the drafter's own weights; reading goes through `dspark.drafters.files`, as
for DSpark checkpoints, so shards and the shard-name checks work the same.
"""

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
from safetensors.torch import save_file
from torch import nn

from dspark.drafters.base import Drafter
from dspark.drafters.draft_vocab import DraftVocabMixin, check_draft_vocab_size, check_draft_vocab_weights
from dspark.drafters.files import CONFIG_FILE, WEIGHTS_FILE, read_config_json, read_weights
from dspark.drafters.layers import DraftShape, target_layer_shape
from dspark.errors import DrafterLoadError
from dspark.sampling import SamplingParams, probabilities, sample
from dspark.target import Target

# -- configuration -----------------------------------------------------------------------------


@dataclass
class DraftLayerConfig(DraftShape):
    """Shape of a Llama-style draft layer at the target's hidden size."""

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    #: DeepSpec convention: id L = output of target layer L (0-based), -1 = embeddings; () = default.
    target_layer_ids: tuple[int, ...] = ()
    #: block size γ: TTT steps / MTP depths the drafter is trained for (and drafts at most, for MTP).
    num_speculative_tokens: int = 7
    #: EAGLE-3's reduced draft vocabulary (`DraftVocabMixin`): the drafter predicts only this many target ids.
    #: None = the full vocabulary.
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if self.draft_vocab_size is not None:
            self.draft_vocab_size = int(self.draft_vocab_size)
        check_draft_vocab_size(self.draft_vocab_size, self.vocab_size)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features read: len(target_layer_ids) * D."""
        return len(self.target_layer_ids) * self.hidden_size

    @staticmethod
    def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
        raise NotImplementedError

    @classmethod
    def for_target(cls, target: Any, **overrides: Any) -> "DraftLayerConfig":
        """A config with the target's layer shape; any field can be overridden."""
        _, lm_head, text = target_parts(target)
        values = dict(
            **target_layer_shape(text),
            vocab_size=int(lm_head.weight.shape[0]),
            target_layer_ids=cls.default_layer_ids(int(text.num_hidden_layers)),
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict:
        values = asdict(self)
        values["target_layer_ids"] = list(self.target_layer_ids)
        if values["draft_vocab_size"] is None:  # full-vocabulary configs stay what other loaders expect
            del values["draft_vocab_size"]
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "DraftLayerConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in known})


# -- the target's frozen embedding and LM head -------------------------------------------------


def target_parts(target: Any) -> tuple[nn.Module, nn.Module, Any]:
    """(embedding, LM head, text config) of a `Target` or an HF causal LM."""
    model = target.model if isinstance(target, Target) else target
    return model.get_input_embeddings(), model.get_output_embeddings(), model.config.get_text_config()


class SharedHeadsMixin(DraftVocabMixin):
    """Uses the target's embedding and LM head without owning them: they are kept in a plain tuple,
    so they are neither registered, saved, trained nor moved with the drafter. The head's logits are
    over the draft vocabulary (all of the target's without `draft_vocab_size`)."""

    _shared: tuple[nn.Module, nn.Module]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._shared[0](input_ids).to(self.dtype)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.draft_logits(hidden, self._shared[1])

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


# -- checkpoints -------------------------------------------------------------------------------


def save_checkpoint(model: nn.Module, directory: str | Path, architecture: str, drafter_type: str,
                    extra: dict | None = None) -> None:
    """config.json (DeepSpec/vLLM style + a `dspark` field) and model.safetensors (own weights only)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture], **model.config.to_dict(), **(extra or {})}
    config["dspark"] = {"drafter_type": drafter_type}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def read_checkpoint(directory: str | Path, drafter_type: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, weights) of a checkpoint directory; DrafterLoadError on anything unreadable or on a
    checkpoint of another drafter type."""
    directory = Path(directory)
    config = read_config_json(directory)
    declared = (config.get("dspark") or {}).get("drafter_type", drafter_type)
    if declared != drafter_type:
        raise DrafterLoadError(f"{directory} holds a {declared!r} drafter, not {drafter_type!r}")
    return config, read_weights(directory)


def parse_config(config_cls: type[DraftLayerConfig], values: dict) -> DraftLayerConfig:
    """`config_cls` from a config.json dict; DrafterLoadError instead of the dataclass's own errors."""
    try:
        return config_cls.from_dict(values)
    except (TypeError, ValueError) as error:
        raise DrafterLoadError(f"invalid drafter config: {error}") from error


def build_for_target(model_cls: type, config: DraftLayerConfig, target: Any,
                     weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """The drafter on the target's device and dtype, checked against the target's shape."""
    embed, lm_head, text = target_parts(target)
    hidden, vocab, num_layers = int(text.hidden_size), int(lm_head.weight.shape[0]), int(text.num_hidden_layers)
    if config.hidden_size != hidden or embed.weight.shape[1] != hidden:
        raise DrafterLoadError(f"drafter hidden size {config.hidden_size} does not match the target's {hidden}")
    if config.vocab_size != vocab:
        raise DrafterLoadError(f"drafter vocabulary of {config.vocab_size} does not match the target's {vocab}")
    bad = [i for i in config.target_layer_ids if not -1 <= i < num_layers]
    if bad or not config.target_layer_ids:
        raise DrafterLoadError(f"target layer ids {config.target_layer_ids} do not fit a {num_layers}-layer target")
    model = model_cls(config, embed, lm_head).to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
    if weights is not None:
        check_draft_vocab_weights(weights, config.draft_vocab_size, config.vocab_size, "checkpoint")
        try:
            model.load_state_dict(weights, strict=True)
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0][:300]
            raise DrafterLoadError(f"drafter weights do not fit its config: {first}") from error
    return model


class BaselineModel(SharedHeadsMixin):
    """Building a baseline model for a target, fresh or from a checkpoint of its `drafter_type`."""

    config_cls: ClassVar[type[DraftLayerConfig]]
    drafter_type: ClassVar[str]

    @classmethod
    def for_target(cls, target: Any, **overrides: Any) -> Self:
        """A freshly initialised drafter shaped like the target (any config field can be overridden)."""
        return build_for_target(cls, cls.config_cls.for_target(target, **overrides), target)

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: Any) -> Self:
        """Load a checkpoint for `target` (a `Target` or HF causal LM); DrafterLoadError if it does not fit."""
        values, weights = read_checkpoint(directory, cls.drafter_type)
        return build_for_target(cls, parse_config(cls.config_cls, values), target, weights)


# -- drafting ----------------------------------------------------------------------------------


def pick_token(probs: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Draw from exactly `probs` (the q handed to verification); the argmax when greedy (one-hot)."""
    return probs.argmax(-1) if sampling.greedy else sample(probs, generator)


def checked_features(features: torch.Tensor | None, config: DraftLayerConfig, device: torch.device) -> torch.Tensor:
    """Target features (n, F) moved to the drafter, or a clear error if the target does not tap them."""
    if features is None:
        raise ValueError(
            f"this drafter needs target features: build the Target with layer_ids={config.target_layer_ids}"
        )
    if features.dim() != 2 or features.shape[-1] != config.feature_size:
        raise ValueError(
            f"target features have shape {tuple(features.shape)}, the drafter reads (n, {config.feature_size}) "
            f"(layers {config.target_layer_ids})"
        )
    return features.to(device)


class BaselineDrafter(Drafter):
    """Per-request drafting around a `BaselineModel` (`model_cls`): its config, shape and checkpoint I/O."""

    model_cls: ClassVar[type[BaselineModel]]

    def __init__(self, model: BaselineModel) -> None:
        self.model = model.eval()
        self.config = model.config
        self.target_layer_ids = model.config.target_layer_ids
        self.vocab_size = model.config.vocab_size

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: Any) -> Self:
        return cls(cls.model_cls.from_pretrained(directory, target))

    def save_pretrained(self, directory: str | Path) -> None:
        self.model.save_pretrained(directory)

    def checked(self, features: torch.Tensor | None) -> torch.Tensor:
        """`checked_features` against this drafter's config, on its device."""
        return checked_features(features, self.config, self.model.device)

    @staticmethod
    def check_feature_count(num_features: int, context_length: int) -> None:
        """RuntimeError unless the drafter holds features of every position before the anchor."""
        if num_features != context_length - 1:
            raise RuntimeError(
                f"the drafter has features of {num_features} positions but the context before the anchor has "
                f"{context_length - 1}: commit the features of every position that entered the target cache"
            )

    def draw(self, logits: torch.Tensor, sampling: SamplingParams,
             generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, q): the processed distribution of `logits` (over the draft vocabulary) and a token drawn
        from exactly it, as a target id and a distribution over the target's vocabulary."""
        probs = probabilities(logits, sampling)
        token = pick_token(probs, sampling, generator)
        return self.model.to_target_ids(token), self.model.scatter_to_target(probs)
