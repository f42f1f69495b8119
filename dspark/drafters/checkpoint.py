"""DSpark checkpoints in DeepSpec's layout: `config.json` + `model.safetensors`.

The config is a Qwen3 config plus DeepSpec's DSpark fields (`architectures: ["Qwen3DSparkModel"]`,
`block_size`, `target_layer_ids`, ...) so checkpoints move both ways between DeepSpec and us; our own
extras live under a `dspark` sub-dict. The target's embedding and LM head are not written by default
(they are the target's, frozen) but are read when present, as in DeepSpec releases.

A drafter with a reduced draft vocabulary (EAGLE-3 style) also writes top-level `draft_vocab_size` in
config.json and its `d2t` / `t2d` buffers in model.safetensors; only we load those (DeepSpec, llama.cpp
and SGLang read full-vocabulary DSpark checkpoints, whose files stay exactly as before). A drafter with
`last_context_input` writes top-level `last_context_input: true` and a `last_context_proj` weight, which
likewise only we load.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dspark.drafters.draft_vocab import check_draft_vocab_weights
from dspark.drafters.dspark import DSparkModel
from dspark.drafters.dspark_config import DSparkConfig
from dspark.drafters.dspark_drafter import DSparkDrafter
from dspark.drafters.files import CONFIG_FILE, WEIGHTS_FILE, read_config_json, read_weights
from dspark.errors import DrafterLoadError

ARCHITECTURE = "Qwen3DSparkModel"
EMBEDDING_KEYS = ("embed_tokens.weight", "lm_head.weight")
FORMAT_VERSION = 1


def config_to_dict(config: DSparkConfig, dtype: torch.dtype | None = None) -> dict:
    data = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "vocab_size": config.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_hidden_layers": config.num_hidden_layers,
        "num_target_layers": config.num_target_layers,
        "block_size": config.block_size,
        "target_layer_ids": list(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "num_anchors": config.num_anchors,
        "markov_rank": config.markov_rank,
        "markov_head_type": config.markov_head_type,
        "enable_confidence_head": config.enable_confidence_head,
        "confidence_head_with_markov": config.confidence_head_with_markov,
        "dspark": {
            "format_version": FORMAT_VERSION,
            "drafter_type": "dspark" if config.markov_head_type else "dflash",
            "calibration_temperatures": config.calibration_temperatures,
        },
    }
    if config.calibration_by_sampling:  # JSON keys are strings: "0", "1", "0.7"
        data["dspark"]["calibration_by_sampling"] = {
            f"{t:g}": temps for t, temps in sorted(config.calibration_by_sampling.items())}
    if config.calibration_biases is not None:  # Platt biases: absent for temperature-only calibration
        data["dspark"]["calibration_biases"] = config.calibration_biases
    if config.calibration_biases_by_sampling:
        data["dspark"]["calibration_biases_by_sampling"] = {
            f"{t:g}": biases for t, biases in sorted(config.calibration_biases_by_sampling.items())}
    if config.draft_vocab_size is not None:  # absent for full-vocabulary checkpoints: their config is unchanged
        data["draft_vocab_size"] = config.draft_vocab_size
    if config.last_context_input:  # likewise absent unless used
        data["last_context_input"] = True
    if dtype is not None:
        data["dtype"] = data["torch_dtype"] = str(dtype).removeprefix("torch.")
    return data


def config_from_dict(data: dict, where: str = "config") -> DSparkConfig:
    """DSparkConfig from one of our configs or a DeepSpec Qwen3 DSpark config."""
    architectures = data.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise DrafterLoadError(f"{where}: architectures {architectures} is not [{ARCHITECTURE!r}] (DSpark)")
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "num_hidden_layers",
                "num_target_layers", "target_layer_ids", "mask_token_id", "block_size")
    missing = [name for name in required if data.get(name) is None]
    if missing:
        raise DrafterLoadError(f"{where}: missing {', '.join(missing)}")
    if data.get("attention_bias") or data.get("hidden_act", "silu") != "silu":
        raise DrafterLoadError(f"{where}: only silu layers without attention bias are supported")
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":
        raise DrafterLoadError(f"{where}: rope type {rope_type!r} is not supported (only default RoPE)")
    markov_rank = int(data.get("markov_rank") or 0)
    if markov_rank and not data.get("markov_head_type"):
        raise DrafterLoadError(f"{where}: markov_rank > 0 needs markov_head_type")
    heads = int(data["num_attention_heads"])
    extras = data.get("dspark") or {}
    by_sampling = extras.get("calibration_by_sampling")
    biases_by_sampling = extras.get("calibration_biases_by_sampling")
    for name, table in (("calibration_by_sampling", by_sampling),
                        ("calibration_biases_by_sampling", biases_by_sampling)):
        if table is not None and not isinstance(table, dict):
            raise DrafterLoadError(f"{where}: dspark.{name} must map sampling temperatures to lists")
    try:
        if by_sampling is not None:
            by_sampling = {float(t): temps for t, temps in by_sampling.items()}
        if biases_by_sampling is not None:
            biases_by_sampling = {float(t): biases for t, biases in biases_by_sampling.items()}
        return DSparkConfig(
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
            vocab_size=int(data["vocab_size"]),
            num_target_layers=int(data["num_target_layers"]),
            mask_token_id=int(data["mask_token_id"]),
            target_layer_ids=tuple(data["target_layer_ids"]),
            rms_norm_eps=float(data.get("rms_norm_eps") or 1e-6),
            rope_theta=float(data.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            block_size=int(data["block_size"]),
            num_hidden_layers=int(data["num_hidden_layers"]),
            markov_rank=markov_rank,
            markov_head_type=data.get("markov_head_type") if markov_rank else None,
            enable_confidence_head=bool(data.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(data.get("confidence_head_with_markov", True)),
            calibration_temperatures=extras.get("calibration_temperatures"),
            calibration_by_sampling=by_sampling,
            calibration_biases=extras.get("calibration_biases"),
            calibration_biases_by_sampling=biases_by_sampling,
            num_anchors=int(data.get("num_anchors") or 512),
            draft_vocab_size=data.get("draft_vocab_size"),
            last_context_input=bool(data.get("last_context_input", False)),
        )
    except (ValueError, TypeError) as error:
        raise DrafterLoadError(f"{where}: {error}") from error


def read_config(path: str | Path) -> DSparkConfig:
    return config_from_dict(read_config_json(path), str(Path(path) / CONFIG_FILE))


def save_pretrained(
    model: DSparkModel,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    include_embeddings: bool = False,
) -> None:
    """Write config.json + model.safetensors; `dtype=torch.float16` halves the size.

    The embedding and LM head are the target's and are left out unless `include_embeddings`.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if k not in EMBEDDING_KEYS}
    if include_embeddings:
        embed_tokens, lm_head = model.embeddings()
        state[EMBEDDING_KEYS[0]], state[EMBEDDING_KEYS[1]] = embed_tokens.weight, lm_head.weight
    dtype = dtype or model.dtype
    # copy=True also unties shared storage (tied embeddings), which safetensors refuses to write
    tensors = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype, copy=True).contiguous()
               for k, v in state.items()}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config_to_dict(model.config, dtype), indent=2) + "\n")


def _frozen_embeddings(embed: torch.Tensor, head: torch.Tensor) -> tuple[nn.Module, nn.Module]:
    embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
    lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False, dtype=head.dtype)
    lm_head.weight = nn.Parameter(head, requires_grad=False)
    return embed_tokens, lm_head


def load_model(
    path: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> DSparkModel:
    """The drafter alone (no target): for training, calibration and inspection. Stored embedding/LM
    head weights, when present, become the model's own; otherwise call `share_embeddings`."""
    path = Path(path)
    if not path.is_dir():
        raise DrafterLoadError(f"drafter directory not found: {path}")
    config = read_config(path)
    weights = read_weights(path)
    weights.pop("rotary_emb.inv_freq", None)
    embed, head = weights.pop(EMBEDDING_KEYS[0], None), weights.pop(EMBEDDING_KEYS[1], None)
    check_draft_vocab_weights(weights, config.draft_vocab_size, config.vocab_size, path)
    model = DSparkModel(config)
    expected = model.state_dict()
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        raise DrafterLoadError(
            f"drafter weights in {path} do not match its config.json: "
            f"missing {missing[:6]}, unexpected {unexpected[:6]}"
        )
    wrong = [f"{k} {tuple(v.shape)} != {tuple(expected[k].shape)}" for k, v in weights.items()
             if v.shape != expected[k].shape]
    if wrong:
        raise DrafterLoadError(f"drafter weights in {path} have the wrong shape: {'; '.join(wrong[:6])}")
    stored_dtype = next(v.dtype for v in weights.values() if v.is_floating_point())  # not d2t's int64
    model = model.to(device=device, dtype=dtype or stored_dtype)
    model.load_state_dict(weights)
    if (embed is None) != (head is None):
        raise DrafterLoadError(f"drafter weights in {path} hold only one of {EMBEDDING_KEYS}")
    if embed is not None:
        shape = (config.vocab_size, config.hidden_size)
        if tuple(embed.shape) != shape or tuple(head.shape) != shape:
            raise DrafterLoadError(
                f"drafter {path}: stored embedding {tuple(embed.shape)} / LM head {tuple(head.shape)} "
                f"do not match vocab_size x hidden_size {shape}"
            )
        embed, head = embed.to(model.device, model.dtype), head.to(model.device, model.dtype)
        model.own_embeddings(*_frozen_embeddings(embed, head))
    return model.eval()


def _target_parts(target) -> tuple[nn.Module, nn.Module, int, int]:
    """(embedding, LM head, hidden size, number of layers) of an HF model or a dspark `Target`."""
    model = target if hasattr(target, "get_input_embeddings") else target.model
    text = model.config.get_text_config()
    return (model.get_input_embeddings(), model.get_output_embeddings(), int(text.hidden_size),
            int(text.num_hidden_layers))


def embeddings_in_dtype(embed_tokens: nn.Module, lm_head: nn.Module, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """Frozen copies of the target's embeddings / LM head in the drafter's dtype (one copy if tied).

    Drafting in bf16 on a CPU with AVX512-BF16 is several times faster than fp32 while the target
    stays fp32; the draft's precision never affects losslessness (q is what the draft sampled from).
    """
    if embed_tokens.weight.dtype == dtype and lm_head.weight.dtype == dtype:
        return embed_tokens, lm_head
    tied = lm_head.weight.data_ptr() == embed_tokens.weight.data_ptr()
    new_embed = nn.Embedding.from_pretrained(embed_tokens.weight.detach().to(dtype), freeze=True)
    new_head = nn.Linear(lm_head.weight.shape[1], lm_head.weight.shape[0], bias=False,
                         device=lm_head.weight.device, dtype=dtype)
    new_head.weight = new_embed.weight if tied else nn.Parameter(lm_head.weight.detach().to(dtype), False)
    return new_embed, new_head


def load_dspark(path: str | Path, target, *, dtype: torch.dtype | None = None) -> DSparkDrafter:
    """A DSparkDrafter for `target` (HF causal LM or dspark `Target`), on its device and, by default,
    in its dtype. Refuses a drafter trained for a different target."""
    path = Path(path)
    if not path.is_dir():
        raise DrafterLoadError(f"drafter directory not found: {path}")
    embed_tokens, lm_head, hidden_size, num_layers = _target_parts(target)
    config = read_config(path)
    target_vocab = int(lm_head.weight.shape[0])
    problems = []
    if config.vocab_size != target_vocab:
        problems.append(f"vocabulary size {config.vocab_size} vs target {target_vocab}")
    if config.hidden_size != hidden_size:
        problems.append(f"hidden size {config.hidden_size} vs target {hidden_size}")
    if config.num_target_layers != num_layers:
        problems.append(f"number of target layers {config.num_target_layers} vs target {num_layers}")
    if problems:
        raise DrafterLoadError(
            f"drafter {path} was trained for a different target model: {'; '.join(problems)}"
        )
    dtype = dtype or embed_tokens.weight.dtype
    embed_tokens, lm_head = embeddings_in_dtype(embed_tokens, lm_head, dtype)
    model = load_model(path, device=embed_tokens.weight.device, dtype=dtype)
    if model.owns_embeddings:
        own_embed, own_head = model.embeddings()
        same = torch.equal(own_embed.weight, embed_tokens.weight.to(own_embed.weight.dtype)) and torch.equal(
            own_head.weight, lm_head.weight.to(own_head.weight.dtype)
        )
        if same:  # the usual case (DeepSpec stores frozen copies): don't keep a second copy
            model.share_embeddings(embed_tokens, lm_head)
    else:
        model.share_embeddings(embed_tokens, lm_head)
    return DSparkDrafter(model)
