"""Drafter registry: `none`, `ngram`, `default` (the shipped checkpoint), or a checkpoint/model path; any of
the model drafters followed by `+ngram` drafts by prompt lookup where the text repeats (`lookup_first`)."""

from pathlib import Path

import torch

from dspark.drafters.base import Draft, Drafter, NoDrafter
from dspark.drafters.files import read_config_json
from dspark.drafters.ngram import NgramDrafter
from dspark.errors import DrafterLoadError
from dspark.packed import pack_linears

LOOKUP_SUFFIX = "+ngram"
#: what `generate`, `serve`, the API and `bench load` draft with unless told: the shipped DSpark drafter, with
#: prompt lookup where the text repeats (session 9, 4 humaneval prompts: τ 2.81 vs 1.77, 2.34x vs 1.66x HF)
DEFAULT_DRAFTER = "default" + LOOKUP_SUFFIX
SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-dspark"

__all__ = ["Draft", "Drafter", "NoDrafter", "NgramDrafter", "load_drafter", "SHIPPED_DRAFTER", "DEFAULT_DRAFTER"]


def _checkpoint_kind(config: dict) -> str:
    """Which drafter family a config.json describes (DeepSpec/vLLM architecture names)."""
    declared = (config.get("dspark") or {}).get("drafter_type")
    if declared:
        return declared
    architectures = " ".join(config.get("architectures") or [])
    if "DSpark" in architectures and "MTP" not in architectures:
        return "dspark"
    if "Eagle3" in architectures or "eagle3" in architectures.lower():
        return "eagle3"
    if "MTP" in architectures:
        return "mtp"
    return "draft_lm"


def default_draft_dtype(target_model) -> torch.dtype:
    """bf16 on CPUs with native bf16 matmuls (several times faster drafting), else the target's dtype."""
    if target_model.device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return target_model.dtype


def load_drafter(spec: str, target_model, *, ngram_max: int = 3, ngram_min: int = 1,
                 draft_dtype: torch.dtype | None = None) -> Drafter:
    """Resolve a drafter spec against a loaded target model (HF `PreTrainedModel`).

    `draft_dtype` applies to DSpark/DFlash drafters; default `default_draft_dtype(target_model)`."""
    if spec.endswith(LOOKUP_SUFFIX) and spec != LOOKUP_SUFFIX.lstrip("+"):
        from dspark.drafters.lookup_first import LookupFirstDrafter

        model = load_drafter(spec.removesuffix(LOOKUP_SUFFIX), target_model, draft_dtype=draft_dtype)
        if isinstance(model, NoDrafter | NgramDrafter):
            raise DrafterLoadError(f"{spec!r}: +ngram completes a model drafter (default or a checkpoint), "
                                   "not none or ngram")
        return LookupFirstDrafter(model)
    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter(max_ngram=ngram_max, min_ngram=ngram_min)
    if spec == "default":
        if (SHIPPED_DRAFTER / "config.json").is_file():
            return load_drafter(str(SHIPPED_DRAFTER), target_model, draft_dtype=draft_dtype)
        return NgramDrafter(max_ngram=ngram_max, min_ngram=ngram_min)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise DrafterLoadError(f"drafter must be none, ngram, default or a checkpoint directory (optionally followed "
                               f"by +ngram); not found: {spec}")
    kind = _checkpoint_kind(read_config_json(path))
    if kind in ("dspark", "dflash"):
        from dspark.drafters.checkpoint import load_dspark

        return _packed(load_dspark(path, target_model, dtype=draft_dtype or default_draft_dtype(target_model)))
    if kind == "eagle3":
        from dspark.drafters.eagle3 import Eagle3Drafter

        return _packed(Eagle3Drafter.from_pretrained(path, target_model))
    if kind == "mtp":
        from dspark.drafters.mtp import MTPDrafter

        return _packed(MTPDrafter.from_pretrained(path, target_model))
    return _load_draft_lm(path, target_model)


def _packed(drafter: Drafter) -> Drafter:
    """A drafter's linear layers reordered once for oneDNN where it drafts in bf16 on a CPU with native bf16
    (`dspark.packed`: the same numbers, about half the matmul time at a round's few rows)."""
    pack_linears(drafter.model)
    return drafter


def _load_draft_lm(path: Path, target_model) -> Drafter:
    from transformers import AutoModelForCausalLM

    from dspark.drafters.draft_lm import DraftLMDrafter

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=target_model.dtype, local_files_only=True)
    except Exception as error:
        first = (str(error).strip() or type(error).__name__).splitlines()[0][:300]
        raise DrafterLoadError(f"could not load draft model {path}: {first}") from error
    draft_vocab = model.get_output_embeddings().weight.shape[0]
    target_vocab = target_model.get_output_embeddings().weight.shape[0]
    if draft_vocab != target_vocab:
        raise DrafterLoadError(
            f"draft model {path} has a vocabulary of {draft_vocab} tokens but the target has {target_vocab}: "
            "a draft model must share the target's tokenizer"
        )
    return DraftLMDrafter(model.to(target_model.device))
