"""`TrainConfig`: every knob of `dspark train`, read from YAML plus `key=value` overrides."""

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from dspark.errors import DsparkError

DRAFTER_TYPES = ("dspark", "dflash", "eagle3", "mtp")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class TrainConfig:
    # -- drafter -------------------------------------------------------------------------------
    drafter_type: str = "dspark"  # dspark | dflash | eagle3 | mtp
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn (dspark only)
    markov_rank: int = 256
    num_draft_layers: int = 1  # DSpark/DFlash layers, MTP modules (EAGLE-3: always 1)
    block_size: int = 7  # γ: block size / TTT steps / MTP depths
    target_layer_ids: list[int] | None = None  # None: the drafter type's default
    mask_token_id: int | None = None  # None: the last vocabulary id (DSpark/DFlash)
    init_from_target: bool = False  # DSpark/DFlash: start the draft layers from the target's last layers
    init_from: str | None = None  # DSpark/DFlash: start from this drafter checkpoint (fine-tune on new data)
    # -- target and data -----------------------------------------------------------------------
    target: str = "default"
    data: str = ""  # corpus (.safetensors, `dspark data pack`) or JSONL of {"messages": [...]} / {"prompt_ids", ...}
    feature_cache: str | None = None  # directory of `dspark data features` for `data`: the target never runs
    online_features: bool = False  # corpus `data`, the cache's features and top-k teacher computed per batch
    top_k: int = 32  # teacher tokens per position with online_features (a cache keeps its own)
    draft_vocab_size: int | None = None  # any drafter: LM head over the N most frequent answer tokens (EAGLE-3 style)
    refresh_draft_vocab: bool = False  # with init_from: choose the draft vocabulary again on `data` (Markov rows carry)
    last_context_input: bool = False  # DSpark/DFlash: slots also read the projected feature before the anchor
    heldout_fraction: float = 0.02
    max_eval_sequences: int = 64
    seq_len: int = 512
    # -- optimisation --------------------------------------------------------------------------
    batch_size: int = 4  # global, in sequences; split across ranks
    length_grouping: int = 0  # batches of similar length from windows of N batches (HF group_by_length); 0 = off
    anchors_per_seq: int = 64
    lr: float = 6e-4
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio at max_steps
    weight_decay: float = 0.01
    warmup_steps: int = 20
    max_steps: int = 1000
    grad_clip: float = 1.0
    # loss weights; None = the drafter type's default (dspark 0.1/0.9/1.0, others CE only)
    ce_weight: float | None = None
    tv_weight: float | None = None
    conf_weight: float | None = None
    decay_lambda: float = 4.0  # λ of the position weights w_k = exp(-(k-1)/λ)
    ce_first_steps: int = 0  # steps of cross-entropy (+ confidence BCE) before the configured mix
    # -- run -----------------------------------------------------------------------------------
    seed: int = 0  # initialisation, data order, anchors
    split_seed: int | None = None  # the held-out split (None: seed); keep it when a run continues another on a new seed
    output_dir: str = "runs/dspark"
    save_every: int = 100
    eval_every: int = 100
    log_every: int = 1
    keep_checkpoints: int = 2  # 0 keeps all
    threads: int = 0  # torch intra-op threads per process; 0 = torch's default
    device: str = "auto"  # auto | cpu | cuda
    target_dtype: str = "float32"  # or auto: bfloat16 where the hardware runs it natively, else float32
    #: none | bfloat16 | float16: autocast the drafter's forward (the loss stays fp32); auto: bfloat16 where
    #: native, else none (emulated bf16 made a step 18x slower than fp32 on an AVX2-only CPU, session 12)
    autocast: str = "none"
    save_dtype: str = "float32"  # dtype of the final drafter weights (checkpoints stay float32)
    tensorboard: bool = True  # also log to TensorBoard when it is installed
    progress: bool = True  # tqdm bar on rank 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.drafter_type not in DRAFTER_TYPES:
            raise DsparkError(f"drafter_type must be one of {', '.join(DRAFTER_TYPES)}, got {self.drafter_type!r}")
        positive = ("block_size", "num_draft_layers", "seq_len", "batch_size", "anchors_per_seq", "max_steps",
                    "save_every", "eval_every", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise DsparkError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise DsparkError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.lr <= 0 or self.warmup_steps < 0 or self.grad_clip < 0 or self.markov_rank < 0:
            raise DsparkError("lr must be > 0 and warmup_steps, grad_clip, markov_rank >= 0")
        if self.target_dtype not in ("auto", *DTYPES):
            raise DsparkError(f"target_dtype must be auto or one of {', '.join(DTYPES)}, got {self.target_dtype!r}")
        if self.save_dtype not in DTYPES:
            raise DsparkError(f"save_dtype must be one of {', '.join(DTYPES)}, got {self.save_dtype!r}")
        if self.autocast not in ("none", "auto", "bfloat16", "float16"):
            raise DsparkError(f"autocast must be none, auto, bfloat16 or float16, got {self.autocast!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 2:
            raise DsparkError(f"draft_vocab_size must be >= 2, got {self.draft_vocab_size}")
        if self.refresh_draft_vocab and not (self.init_from and self.draft_vocab_size and self.reads_corpus
                                             and self.drafter_type in ("dspark", "dflash")):
            raise DsparkError("refresh_draft_vocab chooses a DSpark/DFlash checkpoint's draft vocabulary again on a "
                              "corpus: it needs init_from, draft_vocab_size and a corpus (feature_cache or "
                              "online_features)")
        if self.online_features and self.feature_cache:
            raise DsparkError("online_features computes what feature_cache would read: set one of them, not both")
        if self.online_features and not str(self.data).endswith(".safetensors"):
            raise DsparkError(f"online_features needs a corpus (.safetensors, `dspark data pack`) as data, got "
                              f"{self.data!r}")
        if self.length_grouping < 0:
            raise DsparkError(f"length_grouping must be >= 0 (0 = off), got {self.length_grouping}")
        if self.top_k < 1:
            raise DsparkError(f"top_k must be >= 1, got {self.top_k}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise DsparkError(f"device must be auto, cpu or cuda, got {self.device!r}")

    @property
    def reads_corpus(self) -> bool:
        """The corpus pipeline (top-k teacher, sample ids), its features read from a cache or computed per batch;
        otherwise JSONL conversations with the full-vocabulary online teacher."""
        return bool(self.feature_cache) or self.online_features

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, where: str = "config") -> "TrainConfig":
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(values) - set(hints))
        if unknown:
            raise DsparkError(
                f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(hints))}"
            )
        return cls(**{key: convert(value, hints[key], f"{where}: {key}") for key, value in values.items()})


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                **fields: object) -> TrainConfig:
    """YAML file (optional), then `fields`, then `key=value` strings, later ones winning."""
    values: dict = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError as error:
            raise DsparkError(f"config file not found: {path}") from error
        except yaml.YAMLError as error:
            raise DsparkError(f"config file {path} is not valid YAML: {error}") from error
        if loaded is not None and not isinstance(loaded, dict):
            raise DsparkError(f"config file {path} must hold a mapping of key: value")
        values.update(loaded or {})
    values.update({key: value for key, value in fields.items() if value is not None})
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise DsparkError(f"override {item!r} is not key=value")
        values[key.strip()] = value.strip()
    return TrainConfig.from_dict(values, str(path) if path else "config")


def convert(value: object, hint: object, where: str) -> object:
    """Coerce a YAML value or an override string to the field's type hint."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~", "")):
            return None
        hint = next(arg for arg in args if arg is not type(None))
        args = typing.get_args(hint)
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if hint is int:
            if isinstance(value, float) and not value.is_integer() or isinstance(value, bool):
                raise ValueError(f"not an integer: {value!r}")
            return int(value)
        if hint is float:
            return float(value)
        if hint is str:
            return str(value)
        origin = typing.get_origin(hint)
        if origin is list:
            if isinstance(value, str):
                value = yaml.safe_load(value if value.startswith("[") else f"[{value}]")
            if not isinstance(value, list | tuple):
                raise ValueError(f"not a list: {value!r}")
            return [convert(item, args[0], where) for item in value]
    except (TypeError, ValueError, yaml.YAMLError) as error:
        raise DsparkError(f"{where}: {error}") from error
    raise DsparkError(f"{where}: unsupported type {hint}")
