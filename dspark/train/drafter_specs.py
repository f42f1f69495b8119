"""Per drafter type, how to build it for a target, run every block of a batch, and save it.

A `DrafterSpec` is everything the training loop needs to know about one drafter type: a fresh (or
warm-started) drafter for the target, the logits of every block (B, A, γ, V) from the target features,
its checkpoint format and its default loss mix. Adding a drafter type is one `DrafterSpec` in `DRAFTERS`.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dspark.errors import DsparkError
from dspark.train.config import TrainConfig
from dspark.train.losses import DFLASH_WEIGHTS, DSPARK_WEIGHTS, LossWeights

#: blocks(drafter, features (B, T, F), input_ids (B, T), anchors (B, A)) -> (logits (B, A, γ, V), confidence
#: logits (B, A, γ) or None); slot k of the block of anchor a predicts input_ids[a + k].
BlocksFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class DrafterSpec:
    """What the training loop needs to know about one drafter type."""

    # fresh drafter for (config, HF target); DSpark/DFlash also take `draft_vocab`, see `init_from_checkpoint`
    build: Callable[..., nn.Module]
    blocks: BlocksFn
    save: Callable[[nn.Module, Path, torch.dtype], None]
    weights: LossWeights  # default loss weights


def _dspark_build(config: TrainConfig, target: nn.Module, dflash: bool = False,
                  draft_vocab: torch.Tensor | None = None) -> nn.Module:
    from dspark.drafters.dspark import DSparkModel
    from dspark.drafters.dspark_config import DSparkConfig

    overrides: dict = dict(block_size=config.block_size, num_hidden_layers=config.num_draft_layers,
                           num_anchors=config.anchors_per_seq)
    if dflash:
        overrides.update(markov_head_type=None, markov_rank=0, enable_confidence_head=False)
    else:
        overrides.update(markov_head_type=config.markov_head_type, markov_rank=config.markov_rank,
                         enable_confidence_head=True)
    if config.target_layer_ids:
        overrides["target_layer_ids"] = tuple(config.target_layer_ids)
    if config.mask_token_id is not None:
        overrides["mask_token_id"] = config.mask_token_id
    if config.draft_vocab_size is not None:
        overrides["draft_vocab_size"] = config.draft_vocab_size
    if config.last_context_input:
        overrides["last_context_input"] = True
    try:
        drafter_config = DSparkConfig.for_target(target.config, **overrides)
    except ValueError as error:
        raise DsparkError(f"invalid drafter config: {error}") from error
    drafter = DSparkModel(drafter_config, target.get_input_embeddings(), target.get_output_embeddings())
    if config.init_from:
        init_from_checkpoint(drafter, config.init_from, draft_vocab)
        return drafter
    if config.init_from_target:
        init_from_target(drafter, target)
    warm_start(drafter, target)
    return drafter


@torch.no_grad()
def init_from_checkpoint(drafter: nn.Module, path: str, draft_vocab: torch.Tensor | None = None) -> None:
    """Start from a trained drafter's weights (a fresh optimiser and schedule): continue training
    on new or more data. The architecture must match exactly, except that a drafter trained without
    `last_context_input` may gain it (its projection starts at zero, so training resumes from the same
    function), and that `draft_vocab` (target ids, ascending) replaces the checkpoint's draft vocabulary,
    of any size: a vocabulary chosen on an older corpus misses tokens the new one needs, and a missing token
    can never be drafted. The frozen head needs nothing; the Markov W2 rows of kept ids carry over, new ids
    start at zero. A drafter with more draft layers than the checkpoint gains them on top (`grown_layers`),
    again starting from the same function."""
    from dspark.drafters.checkpoint import load_model
    from dspark.drafters.vocab import carry_rows, offsets_from_ids, t2d_mask
    from dspark.errors import DrafterLoadError

    try:
        source = load_model(path, dtype=torch.float32)
    except DrafterLoadError as error:
        raise DsparkError(f"init_from: {error}") from None
    mine, theirs = drafter.state_dict(), source.state_dict()
    if draft_vocab is not None:
        old_ids = source.draft_to_target().cpu()
        for name in [k for k in theirs if k.endswith("markov_w2.weight")]:
            theirs[name] = carry_rows(theirs[name], old_ids, draft_vocab)
        theirs.update(d2t=offsets_from_ids(draft_vocab), t2d=t2d_mask(draft_vocab, drafter.config.vocab_size))
    added = {k: torch.zeros_like(v) for k, v in mine.items() if k.startswith("last_context_proj.") and k not in theirs}
    theirs.update(added)  # a drafter without the last-context input gains it at zero: the same function
    theirs = grown_layers(theirs, len(drafter.layers))
    mismatched = sorted(k for k in mine.keys() | theirs.keys()
                        if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape)
    if mismatched:
        raise DsparkError(f"init_from {path}: the checkpoint does not match this drafter config "
                          f"({len(mismatched)} tensors differ, e.g. {mismatched[:3]})")
    drafter.load_state_dict(theirs)


def _layer_count(state: dict[str, torch.Tensor]) -> int:
    return len({key.split(".")[1] for key in state if key.startswith("layers.")})


def grown_layers(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A trained drafter's weights with draft layers appended up to `num_layers`: each new layer is a copy of
    the trained top layer with its two residual outputs (`o_proj`, `down_proj`) zeroed, so it adds nothing and
    the grown drafter computes exactly the trained one's blocks; training then finds a use for the extra depth
    (Net2Net-style growth) instead of restarting a deeper drafter from the target. Fewer layers than the
    checkpoint's is left to the caller's shape check."""
    have = _layer_count(state)
    if have == 0 or num_layers <= have:
        return state
    grown = dict(state)
    top = f"layers.{have - 1}."
    for index in range(have, num_layers):
        for key, value in state.items():
            if key.startswith(top):
                name = key[len(top):]
                zero = name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
                grown[f"layers.{index}.{name}"] = torch.zeros_like(value) if zero else value.clone()
    return grown


@torch.no_grad()
def init_from_target(drafter: nn.Module, target: nn.Module) -> None:
    """Start the draft layers as copies of the target's last layers, the context projection as the
    identity on the deepest feature layer, and the final norm as the target's. A small drafter on a
    small data budget then begins from a network that already maps hidden states to next tokens,
    instead of from noise. (The q/k norms have no counterpart in Llama-family targets: they stay 1.)"""
    inner = target.model
    layers = list(inner.layers)
    config = drafter.config
    for draft_layer, source in zip(drafter.layers, layers[-len(drafter.layers):], strict=True):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weight = getattr(source.self_attn, name).weight
            target_weight = getattr(draft_layer.self_attn, name).weight
            if weight.shape != target_weight.shape:
                raise DsparkError(f"init_from_target: {name} shapes differ ({tuple(weight.shape)} vs "
                                  f"{tuple(target_weight.shape)})")
            target_weight.copy_(weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(draft_layer.mlp, name).weight.copy_(getattr(source.mlp, name).weight)
        draft_layer.input_layernorm.weight.copy_(source.input_layernorm.weight)
        draft_layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
    hidden = config.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -hidden:].copy_(torch.eye(hidden))
    drafter.hidden_norm.weight.copy_(layers[-len(drafter.layers)].input_layernorm.weight)
    drafter.norm.weight.copy_(inner.norm.weight)


def warm_start(drafter: nn.Module, target: nn.Module) -> None:
    """The Markov bias W2 starts at zero, so step 0 is DFlash and the sequential head only learns
    what the parallel backbone misses (the rank-r bias is noise otherwise); likewise the last-context
    projection, so step 0 is the plain backbone (from the target's layers) and the fusion is learned."""
    with torch.no_grad():
        head = getattr(drafter, "markov_head", None)
        if head is not None:
            head.markov_w2.weight.zero_()
        fusion = getattr(drafter, "last_context_proj", None)
        if fusion is not None:
            fusion.weight.zero_()


def _dspark_blocks(drafter, features, input_ids, anchors):
    out = drafter(features, input_ids, anchors)
    return out.logits, out.confidence_logits


def _dspark_save(drafter: nn.Module, path: Path, dtype: torch.dtype) -> None:
    from dspark.drafters.checkpoint import save_pretrained

    save_pretrained(drafter, path, dtype=dtype)


def _rows(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """hidden (B, T, D) at rows (B, A) -> (B, A, D)."""
    return hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))


def _eagle3_build(config: TrainConfig, target: nn.Module) -> nn.Module:
    from dspark.drafters.eagle3 import Eagle3Model

    overrides: dict = dict(num_speculative_tokens=config.block_size, draft_vocab_size=config.draft_vocab_size)
    if config.target_layer_ids:
        overrides["target_layer_ids"] = tuple(config.target_layer_ids)
    return Eagle3Model.for_target(target, **overrides)


def _eagle3_blocks(drafter, features, input_ids, anchors):
    """Eagle3Model.forward (training-time test), with the LM head applied only at the rows a - 1 whose
    step j predicts input_ids[a + j + 1] (the feature of a - 1 pairs with the anchor token)."""
    from dspark.drafters.layers import TTTAttend, shift_left

    rows = (anchors - 1).clamp_min(0)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    hidden, attend, logits = drafter.fuse(features), TTTAttend(), []
    for j in range(drafter.config.num_speculative_tokens):
        hidden = drafter.step(shift_left(input_ids, j + 1), hidden, positions + j, attend)
        logits.append(drafter.logits(_rows(hidden, rows)))
    return torch.stack(logits, 2), None


def _mtp_build(config: TrainConfig, target: nn.Module) -> nn.Module:
    from dspark.drafters.mtp import MTPModel

    overrides: dict = dict(num_speculative_tokens=config.block_size, num_modules=config.num_draft_layers,
                           draft_vocab_size=config.draft_vocab_size)
    if config.target_layer_ids:
        overrides["target_layer_ids"] = tuple(config.target_layer_ids)
    return MTPModel.for_target(target, **overrides)


def _mtp_blocks(drafter, features, input_ids, anchors):
    """MTPModel.forward (teacher-forced depths) with the LM head only at the rows a - 1."""
    from dspark.drafters.layers import causal_attend, shift_left

    rows = (anchors - 1).clamp_min(0)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    hidden, logits = features, []
    for depth in range(drafter.config.num_speculative_tokens):
        hidden = drafter.step(depth, shift_left(input_ids, depth + 1), hidden, positions, causal_attend)
        logits.append(drafter.logits(depth, _rows(hidden, rows)))
    return torch.stack(logits, 2), None


def _own_save(drafter: nn.Module, path: Path, dtype: torch.dtype) -> None:
    drafter.save_pretrained(path)  # EAGLE-3 / MTP checkpoints keep the training dtype


DRAFTERS: dict[str, DrafterSpec] = {
    "dspark": DrafterSpec(_dspark_build, _dspark_blocks, _dspark_save, DSPARK_WEIGHTS),
    "dflash": DrafterSpec(lambda c, t, **kw: _dspark_build(c, t, dflash=True, **kw), _dspark_blocks, _dspark_save,
                          DFLASH_WEIGHTS),
    # the baselines are trained on the same data with cross-entropy only by default
    "eagle3": DrafterSpec(_eagle3_build, _eagle3_blocks, _own_save, DFLASH_WEIGHTS),
    "mtp": DrafterSpec(_mtp_build, _mtp_blocks, _own_save, DFLASH_WEIGHTS),
}


class BlockForward(nn.Module):
    """drafter + its `blocks` function as one module, so DDP sees (and syncs after) the whole forward."""

    def __init__(self, drafter: nn.Module, blocks: BlocksFn) -> None:
        super().__init__()
        self.drafter = drafter
        self.blocks = blocks

    def forward(self, features, input_ids, anchors):
        return self.blocks(self.drafter, features, input_ids, anchors)
