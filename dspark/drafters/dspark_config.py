"""DSpark drafter configuration: `DSparkConfig` (shape and options, DeepSpec's field names) and the
default target layers it reads.

Kept apart from the model (`dspark.drafters.dspark`): checkpoint readers and the CLIs build and check
a config, or pick the default layers, without the drafter's modules.
"""

import math
from dataclasses import dataclass

from dspark.drafters.heads import HEAD_TYPES
from dspark.drafters.layers import DraftShape, target_layer_shape


def default_target_layer_ids(num_target_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` layers evenly spaced from layer 1 to L-3 (Qwen3-4B, L=36: 1, 9, 17, 25, 33).

    Never the last layer: HF reports its output after the target's final norm.
    """
    if num_target_layers < 2:
        raise ValueError(f"a DSpark target needs at least 2 layers, got {num_target_layers}")
    last = max(num_target_layers - 3, 0)
    first = min(1, last)
    if count == 1:
        return (last,)
    return tuple(sorted({math.floor(first + i * (last - first) / (count - 1) + 0.5) for i in range(count)}))


@dataclass
class DSparkConfig(DraftShape):
    """Drafter shape and options; field names follow DeepSpec's checkpoint config."""

    num_target_layers: int
    mask_token_id: int
    #: DeepSpec convention: id L = output of target layer L (0-based), -1 = embeddings; () = default.
    target_layer_ids: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    block_size: int = 7
    num_hidden_layers: int = 5
    markov_rank: int = 256
    #: "vanilla" (Markov), "gated", "rnn", or None for no sequential head (DFlash).
    markov_head_type: str | None = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    #: Sequential Temperature Scaling: T_k divides the confidence logit of block position k.
    calibration_temperatures: list[float] | None = None
    #: STS temperatures per sampling temperature they were fitted at, {sampling T: [T_1..T_γ]}. Sampled
    #: drafts survive less often than greedy ones at the same confidence logit, so one set fitted on
    #: greedy rounds over-predicts sampled acceptance (docs/training.md, run 3: +9.6% at T = 1). A request
    #: uses the set fitted nearest its own temperature; `calibration_temperatures` is the fallback.
    calibration_by_sampling: dict[float, list[float]] | None = None
    #: Platt biases next to the temperatures, c_k = σ(z_k / T_k + b_k) (`calibration.fit_sequential_platt`):
    #: a temperature cannot move a head that is off on average. None = all 0 (temperatures alone, what
    #: other loaders apply). Keyed like `calibration_by_sampling`; a sampling temperature missing here has 0.
    calibration_biases: list[float] | None = None
    calibration_biases_by_sampling: dict[float, list[float]] | None = None
    #: training only: anchors sampled per sequence (kept for DeepSpec config compatibility).
    num_anchors: int = 512
    #: EAGLE-3-style reduced draft vocabulary: the drafter predicts only this many target ids (the
    #: model's `d2t` buffer says which). None = the full vocabulary (what DeepSpec, llama.cpp, SGLang load).
    draft_vocab_size: int | None = None
    #: Each slot's input also gets W_a·H_ctx[a-1], the projected target feature of the position that
    #: produced the anchor (EAGLE's fusion of feature and token). Without it every slot must *learn* an
    #: attention head that finds the latest context position, which a CPU-sized budget does not teach
    #: (docs/training.md). An extension of DeepSpec's layout: DeepSpec, llama.cpp and SGLang do not load it.
    last_context_input: bool = False

    def __post_init__(self) -> None:
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers)
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if self.markov_head_type in (None, "", "none") or self.markov_rank == 0:
            self.markov_head_type, self.markov_rank = None, 0
        # W1 lives in the Markov head: without one the confidence head sees h_k alone.
        self.confidence_head_with_markov = bool(
            self.enable_confidence_head and self.confidence_head_with_markov and self.markov_head_type
        )
        if self.calibration_temperatures is not None:
            self.calibration_temperatures = [float(t) for t in self.calibration_temperatures]
        if self.calibration_by_sampling is not None:
            self.calibration_by_sampling = {float(t): [float(x) for x in temps]
                                            for t, temps in self.calibration_by_sampling.items()} or None
        if self.calibration_biases is not None:
            self.calibration_biases = [float(b) for b in self.calibration_biases]
        if self.calibration_biases_by_sampling is not None:
            self.calibration_biases_by_sampling = {float(t): [float(x) for x in biases]
                                                   for t, biases in self.calibration_biases_by_sampling.items()} or None
        if self.draft_vocab_size is not None:
            self.draft_vocab_size = int(self.draft_vocab_size)
        self.validate()

    def validate(self) -> None:
        if self.markov_head_type is not None and self.markov_head_type not in HEAD_TYPES:
            raise ValueError(
                f"markov_head_type must be one of {HEAD_TYPES} or None, got {self.markov_head_type!r}"
            )
        if self.block_size < 1 or self.num_hidden_layers < 1 or self.markov_rank < 0:
            raise ValueError("block_size and num_hidden_layers must be >= 1 and markov_rank >= 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids has duplicates: {self.target_layer_ids}")
        for layer_id in self.target_layer_ids:
            if not -1 <= layer_id < self.num_target_layers:
                raise ValueError(
                    f"target layer id {layer_id} outside [-1, {self.num_target_layers - 1}] "
                    f"for a target of {self.num_target_layers} layers"
                )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary ({self.vocab_size})")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        temperatures = self.calibration_temperatures
        if temperatures is not None and (len(temperatures) != self.block_size or min(temperatures) <= 0):
            raise ValueError(f"need {self.block_size} positive calibration temperatures, got {temperatures}")
        for sampling_temperature, temperatures in (self.calibration_by_sampling or {}).items():
            if not math.isfinite(sampling_temperature) or sampling_temperature < 0:
                raise ValueError(f"calibration sampling temperatures must be finite and >= 0, "
                                 f"got {sampling_temperature}")
            if len(temperatures) != self.block_size or min(temperatures) <= 0:
                raise ValueError(f"need {self.block_size} positive calibration temperatures at sampling temperature "
                                 f"{sampling_temperature:g}, got {temperatures}")
        for where, biases in [("", self.calibration_biases)] + [
                (f" at sampling temperature {t:g}", b) for t, b in (self.calibration_biases_by_sampling or {}).items()]:
            if biases is not None and (len(biases) != self.block_size or not all(map(math.isfinite, biases))):
                raise ValueError(f"need {self.block_size} finite calibration biases{where}, got {biases}")
        unmatched = set(self.calibration_biases_by_sampling or {}) - set(self.calibration_by_sampling or {})
        if unmatched:
            raise ValueError(f"calibration biases at sampling temperatures {sorted(unmatched)} have no temperatures")

    def temperatures_for(self, sampling_temperature: float) -> list[float] | None:
        """The STS temperatures for requests sampled at `sampling_temperature` (0 = greedy): the set
        fitted at the nearest sampling temperature, else `calibration_temperatures` (None = uncalibrated)."""
        return self.calibration_for(sampling_temperature)[0]

    def calibration_for(self, sampling_temperature: float) -> tuple[list[float] | None, list[float] | None]:
        """(temperatures, biases) fitted at the sampling temperature nearest `sampling_temperature`, else
        the fallback pair; None = uncalibrated / no bias."""
        table = self.calibration_by_sampling
        if not table:
            return self.calibration_temperatures, self.calibration_biases
        nearest = min(table, key=lambda t: (abs(t - sampling_temperature), t))
        return table[nearest], (self.calibration_biases_by_sampling or {}).get(nearest)

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features the drafter reads: len(target_layer_ids) * D."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def for_target(cls, target_config, **overrides) -> "DSparkConfig":
        """Drafter whose layers have the target's shape (as DeepSpec builds it); any field can be
        overridden. The default mask token is the last vocabulary id: pass an unused id if the
        tokenizer has one."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        values = dict(
            **target_layer_shape(text),
            vocab_size=int(text.vocab_size),
            num_target_layers=int(text.num_hidden_layers),
            mask_token_id=int(text.vocab_size) - 1,
        )
        values.update(overrides)
        return cls(**values)
