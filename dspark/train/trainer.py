"""The drafter training loop: frozen target, online features, AdamW, checkpoints that resume exactly.

One step = one global batch of `batch_size` sequences. Under `torchrun --nproc-per-node N` each rank takes
a contiguous 1/N of it and the loss is normalised by the *global* Σw (DeepSpec does the same), so the
gradient, and hence the run, is the single-process one up to float summation order. Everything random
is a function of (seed, step, position in the global batch): the data order (a seeded permutation per
epoch), the anchors (one generator per sequence), so resuming from a checkpoint replays the same steps.

Per drafter type, a `DrafterSpec` says how to build the drafter for a target, how to get the logits of
every block (B, A, γ, V) from the target features, and how to save it. Adding a drafter type is one
`DrafterSpec`.
"""

import contextlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dspark.errors import DsparkError
from dspark.train.anchors import anchor_seed, block_labels, target_positions
from dspark.train.cached_data import (
    CachedBatch,
    CachedExample,
    cached_examples,
    make_cached_batch,
    pad_and_anchor,
    split_heldout,
    token_counts,
)
from dspark.train.config import TrainConfig
from dspark.train.feature_cache import FeatureCache, FeatureCacheError
from dspark.train.features import TargetFeatures
from dspark.train.losses import (
    DFLASH_WEIGHTS,
    DSPARK_WEIGHTS,
    LossWeights,
    block_loss,
    block_tau,
    greedy_accepts,
    position_weights,
    topk_block_loss,
)

STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"
CHECKPOINT_PREFIX = "checkpoint-"

# -- drafter types ---------------------------------------------------------------------------

#: blocks(drafter, features (B, T, F), input_ids (B, T), anchors (B, A)) -> (logits (B, A, γ, V), confidence
#: logits (B, A, γ) or None); slot k of the block of anchor a predicts input_ids[a + k].
BlocksFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class DrafterSpec:
    build: Callable[[TrainConfig, nn.Module], nn.Module]  # fresh drafter for (config, HF target)
    blocks: BlocksFn
    save: Callable[[nn.Module, Path, torch.dtype], None]
    weights: LossWeights  # default loss weights


def _dspark_build(config: TrainConfig, target: nn.Module, dflash: bool = False) -> nn.Module:
    from dspark.drafters.dspark import DSparkConfig, DSparkModel

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
    try:
        drafter_config = DSparkConfig.for_target(target.config, **overrides)
    except ValueError as error:
        raise DsparkError(f"invalid drafter config: {error}") from error
    drafter = DSparkModel(drafter_config, target.get_input_embeddings(), target.get_output_embeddings())
    if config.init_from:
        init_from_checkpoint(drafter, config.init_from)
        return drafter
    if config.init_from_target:
        init_from_target(drafter, target)
    warm_start(drafter, target)
    return drafter


@torch.no_grad()
def init_from_checkpoint(drafter: nn.Module, path: str) -> None:
    """Start from a trained drafter's weights (a fresh optimiser and schedule): continue training
    on new or more data. The architecture must match exactly."""
    from dspark.drafters.checkpoint import load_model
    from dspark.errors import DrafterLoadError

    try:
        source = load_model(path, dtype=torch.float32)
    except DrafterLoadError as error:
        raise DsparkError(f"init_from: {error}") from None
    mine, theirs = drafter.state_dict(), source.state_dict()
    mismatched = sorted(k for k in mine.keys() | theirs.keys()
                        if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape)
    if mismatched:
        raise DsparkError(f"init_from {path}: the checkpoint does not match this drafter config "
                          f"({len(mismatched)} tensors differ, e.g. {mismatched[:3]})")
    drafter.load_state_dict(theirs)

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
    what the parallel backbone misses (the rank-r bias is noise otherwise)."""
    head = getattr(drafter, "markov_head", None)
    if head is not None:
        with torch.no_grad():
            head.markov_w2.weight.zero_()


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

    overrides: dict = dict(num_speculative_tokens=config.block_size)
    if config.target_layer_ids:
        overrides["target_layer_ids"] = tuple(config.target_layer_ids)
    return Eagle3Model.for_target(target, **overrides)


def _eagle3_blocks(drafter, features, input_ids, anchors):
    """Eagle3Model.forward (training-time test), with the LM head applied only at the rows a - 1 whose
    step j predicts input_ids[a + j + 1] (the feature of a - 1 pairs with the anchor token)."""
    from dspark.drafters.eagle3 import TTTAttend, shift_left

    rows = (anchors - 1).clamp_min(0)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    hidden, attend, logits = drafter.fuse(features), TTTAttend(), []
    for j in range(drafter.config.num_speculative_tokens):
        hidden = drafter.step(shift_left(input_ids, j + 1), hidden, positions + j, attend)
        logits.append(drafter.logits(_rows(hidden, rows)))
    return torch.stack(logits, 2), None


def _mtp_build(config: TrainConfig, target: nn.Module) -> nn.Module:
    from dspark.drafters.mtp import MTPModel

    overrides: dict = dict(num_speculative_tokens=config.block_size, num_modules=config.num_draft_layers)
    if config.target_layer_ids:
        overrides["target_layer_ids"] = tuple(config.target_layer_ids)
    return MTPModel.for_target(target, **overrides)


def _mtp_blocks(drafter, features, input_ids, anchors):
    """MTPModel.forward (teacher-forced depths) with the LM head only at the rows a - 1."""
    from dspark.drafters.eagle3 import causal_attend, shift_left

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
    "dflash": DrafterSpec(lambda c, t: _dspark_build(c, t, dflash=True), _dspark_blocks, _dspark_save,
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


def loss_weights(config: TrainConfig, step: int | None = None) -> LossWeights:
    """The loss mix of `step`: the drafter type's default unless overridden; during the first
    `ce_first_steps` steps cross-entropy alone (plus the confidence BCE), because far from the teacher
    the L1 term is saturated near 2 and gives almost no gradient."""
    default = DRAFTERS[config.drafter_type].weights
    weights = LossWeights(
        default.ce if config.ce_weight is None else config.ce_weight,
        default.tv if config.tv_weight is None else config.tv_weight,
        default.conf if config.conf_weight is None else config.conf_weight,
    )
    if step is not None and step < config.ce_first_steps:
        return LossWeights(1.0, 0.0, weights.conf)
    return weights


# -- data --------------------------------------------------------------------------------------


@dataclass
class Example:
    input_ids: list[int]
    answer_start: int  # positions [answer_start, len) are the answer (assistant) tokens


def tokenize_conversation(messages: list[dict], tokenizer, finished: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) with the target's chat template; the last message is the answer. A finished
    answer ends with the end-of-turn token the target stopped at; an unfinished one (cut by the
    regeneration's token limit) does not."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("the last message must be the assistant's answer")
    prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer(prompt_text, add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    if full_text.startswith(prompt_text):
        answer = tokenizer(full_text[len(prompt_text):], add_special_tokens=False).input_ids
        if eos in answer:  # drop what the template adds after the end of turn (a newline)
            answer = answer[: answer.index(eos) + 1]
    else:
        answer = tokenizer(messages[-1]["content"], add_special_tokens=False).input_ids
        answer = answer + ([eos] if eos is not None else [])
    if not finished and answer and answer[-1] == eos:
        answer = answer[:-1]
    return prompt, answer


def load_examples(path: str | Path, tokenizer, seq_len: int) -> list[Example]:
    """JSONL of {"messages": [...]} (needs the tokenizer) or pre-tokenised {"prompt_ids", "answer_ids"};
    sequences are cut to seq_len and dropped when fewer than 2 answer tokens remain."""
    path = Path(path)
    if not path.is_file():
        raise DsparkError(f"training data not found: {path}")
    examples = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if "prompt_ids" in record:
                    prompt, answer = list(record["prompt_ids"]), list(record["answer_ids"])
                elif "messages" in record:
                    if tokenizer is None:
                        raise ValueError("the target has no tokenizer: give prompt_ids/answer_ids")
                    prompt, answer = tokenize_conversation(record["messages"], tokenizer,
                                                           bool(record.get("finished", True)))
                else:
                    raise ValueError("expected 'messages' or 'prompt_ids'/'answer_ids'")
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise DsparkError(f"{path}:{number}: {error}") from error
            ids = (prompt + answer)[:seq_len]
            if len(ids) - len(prompt) >= 2:
                examples.append(Example([int(i) for i in ids], len(prompt)))
    if not examples:
        raise DsparkError(f"{path}: no usable conversation (each needs >= 2 answer tokens within seq_len)")
    return examples


def batch_indices(num_train: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Positions (into the training list) of global batch `step`: epoch e is a seeded permutation cut
    into full batches, so a batch is a function of the step alone (that is the data position)."""
    per_epoch = max(num_train // batch_size, 1)
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(num_train, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()
    if num_train < batch_size:
        order = (order * math.ceil(batch_size / num_train))[:batch_size]
    return order[index * batch_size : (index + 1) * batch_size]


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) right-padded
    attention_mask: torch.Tensor  # (B, T)
    answer_mask: torch.Tensor  # (B, T) bool
    anchors: torch.Tensor  # (B, A)
    keep: torch.Tensor  # (B, A) bool: real anchors (not padding)


def make_batch(examples: list[Example], seeds: list[int], num_anchors: int, pad_id: int,
               device: torch.device) -> Batch:
    input_ids, attention_mask, answer_mask, anchors, keep = pad_and_anchor(examples, seeds, num_anchors, pad_id)
    return Batch(input_ids.to(device), attention_mask.to(device), answer_mask.to(device),
                 torch.stack(anchors).to(device), torch.stack(keep).to(device))


# -- distributed ---------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # we initialised the process group, so we tear it down

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (on the compute device: NCCL reduces CUDA tensors only)."""
        if self.world == 1:
            return values
        reduced = values.to(self.device, copy=True)
        dist.all_reduce(reduced)
        return reduced.to(values.device)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def init_distributed(config: TrainConfig) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if config.batch_size % world:
        raise DsparkError(f"batch_size {config.batch_size} is not a multiple of the {world} processes")
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(rank, world, device, owns_group)


# -- checkpoints ---------------------------------------------------------------------------------


def rng_state() -> dict:
    """Every global RNG, as tensors / lists / ints only (loadable with torch.load(weights_only=True))."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(mt), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints (they are renamed into place only once fully written), oldest first."""
    found = [p for p in output_dir.glob(f"{CHECKPOINT_PREFIX}*") if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name)
             and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(directory) into a hidden staging directory, then rename it to `path`: a reader (or a resume
    after a kill) sees the old directory or the complete new one, never a half-written one."""
    staging = path.parent / f".tmp-{path.name}"
    shutil.rmtree(staging, ignore_errors=True)
    write(staging)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(staging, path)


def save_checkpoint(output_dir: Path, step: int, drafter: nn.Module, spec: DrafterSpec,
                    optimizer: torch.optim.Optimizer, scheduler, config: TrainConfig, keep: int) -> Path:
    """checkpoint-<step>/: drafter weights (float32, so that resuming is exact) + trainer_state.pt."""
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "config": config.to_dict(),
    }

    def write(directory: Path) -> None:
        spec.save(drafter, directory, torch.float32)
        torch.save(state, directory / STATE_FILE)

    final = output_dir / f"{CHECKPOINT_PREFIX}{step:07d}"
    write_atomically(final, write)
    if keep > 0:
        for old in checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_resume(resume: str | Path, output_dir: Path) -> Path:
    """'latest' (or True) -> the newest complete checkpoint of output_dir; else a checkpoint directory."""
    if str(resume) in ("latest", "True"):
        found = checkpoints(output_dir)
        if not found:
            raise DsparkError(f"--resume: no checkpoint in {output_dir}")
        return found[-1]
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise DsparkError(f"--resume: {path} is not a checkpoint (no {STATE_FILE})")
    return path


# -- the loop ------------------------------------------------------------------------------------


def lr_lambda(config: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up to lr, then cosine to lr * min_lr_ratio at max_steps."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = min((step - config.warmup_steps) / max(config.max_steps - config.warmup_steps, 1), 1.0)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(drafter: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the drafter's own parameters (the target's embedding/LM head are not among them);
    no weight decay on norms and biases."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


class Logger:
    """JSONL (+ TensorBoard when installed), rank 0 only."""

    def __init__(self, output_dir: Path, config: TrainConfig, start_step: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = output_dir / LOG_FILE
        self.writer = None
        if not enabled:
            return
        if self.path.exists():  # resuming: forget what the interrupted run logged after the checkpoint
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        if config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(output_dir / "tensorboard"))
            except ImportError:
                pass

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclass
class Run:
    """What a training step needs besides the batch."""

    config: TrainConfig
    dist: Dist
    features: TargetFeatures | None  # online teacher (None with a feature cache)
    weights: LossWeights
    pad_id: int
    cache: FeatureCache | None = None
    layer_ids: tuple[int, ...] = ()
    target_to_draft: torch.Tensor | None = None  # reduced draft vocabulary
    draft_to_target: torch.Tensor | None = None


def step_batch(run: Run, examples: list, step: int, first_index: int, seed: int) -> Batch | CachedBatch:
    """The local part of a global batch; first_index = position of examples[0] in the global batch."""
    seeds = [anchor_seed(seed, step, first_index + i) for i in range(len(examples))]
    return step_batch_from_seeds(run, examples, seeds)


def drafter_autocast(config: TrainConfig, device: torch.device):
    """bf16 autocast for the drafter's forward (its LM head over the whole vocabulary dominates a CPU
    step); the loss itself is computed in fp32."""
    if config.autocast == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, config.autocast))


def batch_loss(run: Run, batch: Batch | CachedBatch, module: nn.Module, global_norm: bool = True,
               greedy: bool = False):
    """Loss of one local batch, and (valid (B, A, γ), greedy (B, A, γ) bool or None: the draft's argmax
    is the target's, only when `greedy`: evaluation wants it, a training step does not). With global_norm
    the normaliser is the global Σw / world size, so that DDP's gradient average is the gradient of the
    global weighted mean. The teacher is the online target
    (full logits) or the feature cache (top-k)."""
    config = run.config
    labels, valid = block_labels(batch.input_ids, batch.answer_mask, batch.anchors, batch.keep, config.block_size)
    if run.cache is not None:
        features, target_logits = batch.features, None
    else:
        positions = target_positions(batch.anchors, config.block_size, batch.input_ids.shape[1])
        features, target_logits = run.features(batch.input_ids, batch.attention_mask, positions)
    normalizer = None
    if global_norm:
        w = position_weights(config.block_size, config.decay_lambda, valid.device) * valid.float()
        normalizer = (run.dist.sum(w.sum()) / run.dist.world).clamp_min(1e-6)
    with drafter_autocast(config, features.device):
        logits, confidence_logits = module(features, batch.input_ids, batch.anchors)
    logits = logits.float()
    confidence_logits = None if confidence_logits is None else confidence_logits.float()
    if run.cache is not None:
        out = topk_block_loss(logits, batch.teacher, labels, valid, confidence_logits, run.weights,
                              config.decay_lambda, normalizer, run.target_to_draft)
        agree = greedy_accepts(logits.detach(), batch.teacher, run.draft_to_target) & valid if greedy else None
    else:
        out = block_loss(logits, target_logits, labels, valid, confidence_logits, run.weights, config.decay_lambda,
                         normalizer)
        agree = None
    return out, (valid, agree)


def train_step(run: Run, batch: Batch | CachedBatch, module: nn.Module, drafter: nn.Module,
               optimizer: torch.optim.Optimizer):
    """Forward, backward, clip, AdamW step: (loss output, valid (B, A, γ), gradient norm)."""
    out, (valid, _) = batch_loss(run, batch, module)
    optimizer.zero_grad(set_to_none=True)
    out.total.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), run.config.grad_clip or float("inf"))
    optimizer.step()
    return out, valid, grad_norm


@torch.no_grad()
def evaluate(run: Run, drafter_forward: nn.Module, examples: list) -> dict:
    """Held-out loss terms, expected τ at T = 1 (from the acceptance probabilities 1 − TV) and, with a
    feature cache, at T = 0 (teacher-forced argmax agreement), and per-position acceptance, over all
    ranks, on fixed anchors."""
    config, d = run.config, run.dist
    mine = list(range(d.rank, min(len(examples), config.max_eval_sequences), d.world))
    per_rank = max(config.batch_size // d.world, 1)
    gamma = config.block_size
    names = ("loss", "ce", "tv", "conf", "weight", "tau", "tau_greedy", "blocks")
    sums = dict.fromkeys(names, 0.0)
    accepted, accepted_greedy, counted = (torch.zeros(gamma, dtype=torch.float64) for _ in range(3))
    for start in range(0, len(mine), per_rank):
        indices = mine[start : start + per_rank]
        seeds = [anchor_seed(config.seed + 1, 0, i) for i in indices]
        batch = step_batch_from_seeds(run, [examples[i] for i in indices], seeds)
        out, (valid, greedy) = batch_loss(run, batch, drafter_forward, global_norm=False, greedy=True)
        weight = out.weight_sum.item()
        keep = valid.any(-1)
        for name, value in (("loss", out.total), ("ce", out.ce), ("tv", out.tv), ("conf", out.conf)):
            sums[name] += value.item() * weight
        sums["weight"] += weight
        sums["tau"] += block_tau(1 - out.soft_label, valid)[keep].sum().item()
        sums["blocks"] += keep.sum().item()
        accepted += (out.soft_label * valid).sum((0, 1)).double()
        counted += valid.sum((0, 1)).double()
        if greedy is not None:
            sums["tau_greedy"] += (1 + greedy.long().cumprod(-1).sum(-1))[keep].sum().item()
            accepted_greedy += greedy.sum((0, 1)).double()
    total = d.sum(torch.tensor([sums[n] for n in names], dtype=torch.float64))
    sums = dict(zip(names, total.tolist(), strict=True))
    accepted, accepted_greedy, counted = (d.sum(t) for t in (accepted, accepted_greedy, counted))
    w, blocks = max(sums["weight"], 1e-6), max(sums["blocks"], 1.0)
    result = {f"eval_{n}": sums[n] / w for n in ("loss", "ce", "tv", "conf")}
    result.update(eval_tau=sums["tau"] / blocks, eval_blocks=sums["blocks"])
    result["eval_accept"] = (accepted / counted.clamp_min(1)).tolist()
    if run.cache is not None:
        result["eval_tau_greedy"] = sums["tau_greedy"] / blocks
        result["eval_accept_greedy"] = (accepted_greedy / counted.clamp_min(1)).tolist()
    return result


def step_batch_from_seeds(run: Run, examples: list, seeds: list[int]) -> Batch | CachedBatch:
    if run.cache is not None:
        return make_cached_batch(examples, run.cache, run.layer_ids, seeds, run.config.anchors_per_seq,
                                 run.config.block_size, run.pad_id, run.dist.device)
    return make_batch(examples, seeds, run.config.anchors_per_seq, run.pad_id, run.dist.device)


def train(config: TrainConfig, resume: str | Path | None = None,
          on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train a drafter as `config` says; returns the last step's metrics (and the last eval's).
    `resume`: 'latest' or a checkpoint directory. `on_step(step, metrics)` runs on every rank after each
    step (and its checkpoint)."""
    if not config.data:
        raise DsparkError("no training data: set data=PATH (JSONL of conversations)")
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    d = init_distributed(config)
    output_dir = Path(config.output_dir)
    if d.main:
        output_dir.mkdir(parents=True, exist_ok=True)

    from dspark.loading import load_target

    if not d.main:
        d.barrier()  # rank 0 first: it may convert the default GGUF target once
    target = load_target(config.target, dtype=getattr(torch, config.target_dtype), device=str(d.device))
    if d.main:
        d.barrier()

    spec = DRAFTERS[config.drafter_type]
    torch.manual_seed(config.seed)
    drafter = spec.build(config, target.model).to(d.device).float().train()
    layer_ids = tuple(drafter.config.target_layer_ids)
    tokenizer = target.tokenizer
    pad_id = (tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0)
    run = Run(config, d, None, loss_weights(config), pad_id, layer_ids=layer_ids)
    if config.feature_cache:
        all_examples = open_cached_data(run, config, target, drafter)
    else:
        run.features = TargetFeatures(target.model, layer_ids)
        all_examples = load_examples(config.data, tokenizer, config.seq_len)
    train_ids, eval_ids = split_heldout(len(all_examples), config.heldout_fraction, config.seed)
    train_set = [all_examples[i] for i in train_ids]
    eval_set = [all_examples[i] for i in eval_ids]

    optimizer = build_optimizer(drafter, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    step = 0
    if resume:
        checkpoint = resolve_resume(resume, output_dir)
        state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
        _check_resume_config(state["config"], config, checkpoint)
        drafter.load_state_dict(load_file(str(checkpoint / "model.safetensors"), device=str(d.device)))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        step = int(state["step"])
        if d.main:
            print(f"[dspark] resumed from {checkpoint} at step {step}", file=sys.stderr)
    elif d.main and checkpoints(output_dir):
        print(f"[dspark] warning: {output_dir} holds checkpoints of an earlier run; starting afresh "
              "(use --resume to continue it)", file=sys.stderr)

    module: nn.Module = BlockForward(drafter, spec.blocks)
    if d.world > 1:
        module = DistributedDataParallel(module, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    logger = Logger(output_dir, config, step, d.main)
    if d.main:
        (output_dir / "train_config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        num_params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        print(f"[dspark] training {config.drafter_type} ({num_params / 1e6:.1f}M parameters, target layers "
              f"{list(layer_ids)}) on {len(train_set)} conversations ({len(eval_set)} held out), "
              f"{d.world} process(es) on {d.device}", file=sys.stderr)

    bar = None
    if d.main and config.progress:
        from tqdm import tqdm

        bar = tqdm(total=config.max_steps, initial=step, desc="train", dynamic_ncols=True)
    per_rank = config.batch_size // d.world
    metrics: dict = {}
    eval_metrics: dict = {}
    while step < config.max_steps:
        started = time.perf_counter()
        global_batch = batch_indices(len(train_set), config.batch_size, step, config.seed)
        first = d.rank * per_rank
        examples = [train_set[i] for i in global_batch[first : first + per_rank]]
        batch = step_batch(run, examples, step, first, config.seed)

        lr = scheduler.get_last_lr()[0]
        run.weights = loss_weights(config, step)
        out, valid, grad_norm = train_step(run, batch, module, drafter, optimizer)
        scheduler.step()
        step += 1

        keep = valid.any(-1)
        stats = d.sum(torch.stack([
            out.total.detach(), out.ce, out.tv, out.conf, out.accept,
            block_tau(1 - out.soft_label, valid)[keep].sum(), keep.sum().float(),
            batch.attention_mask.sum().float(), valid.sum().float(),
        ]).double())
        elapsed = time.perf_counter() - started
        metrics = {
            "step": step, "lr": lr, "loss": float(stats[0]) / d.world, "ce": float(stats[1]) / d.world,
            "tv": float(stats[2]) / d.world, "conf": float(stats[3]) / d.world,
            "accept": float(stats[4]) / d.world, "tau": float(stats[5] / stats[6].clamp_min(1)),
            "grad_norm": float(grad_norm), "tokens": int(stats[7]), "supervised": int(stats[8]),
            "tokens_per_s": float(stats[7]) / elapsed, "step_s": elapsed,
        }
        if step % config.log_every == 0 or step == config.max_steps:
            logger.log(metrics)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau']:.2f}",
                            tok_s=f"{metrics['tokens_per_s']:.0f}")
        if step % config.eval_every == 0 or step == config.max_steps:
            if eval_set:
                drafter.eval()
                eval_metrics = evaluate(run, BlockForward(drafter, spec.blocks), eval_set)
                drafter.train()
                logger.log({"step": step, **eval_metrics})
                if bar is not None:
                    bar.write(f"step {step}: eval tau {eval_metrics['eval_tau']:.3f} "
                              f"loss {eval_metrics['eval_loss']:.4f}")
        if step % config.save_every == 0 or step == config.max_steps:
            if d.main:
                save_checkpoint(output_dir, step, drafter, spec, optimizer, scheduler, config,
                                config.keep_checkpoints)
            d.barrier()
        if on_step is not None:
            on_step(step, metrics)

    if bar is not None:
        bar.close()
    if d.main:
        final = output_dir / "final"
        write_atomically(final, lambda directory: spec.save(drafter, directory, getattr(torch, config.save_dtype)))
        print(f"[dspark] drafter written to {final}", file=sys.stderr)
    logger.close()
    d.barrier()
    if d.owns_group:
        dist.destroy_process_group()
    return {**metrics, **eval_metrics}


def open_cached_data(run: Run, config: TrainConfig, target, drafter: nn.Module) -> list[CachedExample]:
    """Corpus + feature cache for `config.data` / `config.feature_cache`: refuse a cache made from another
    target or corpus, choose the reduced draft vocabulary (most frequent answer tokens) if asked."""
    from dspark.train.corpus import load_corpus
    from dspark.train.feature_cache import model_fingerprint

    corpus = load_corpus(config.data)
    cache = FeatureCache.open(config.feature_cache)
    expected = {"target_fingerprint": model_fingerprint(target.model), "corpus_checksum": corpus.checksum}
    stale = [name for name, value in expected.items() if cache.key.get(name) != value]
    if stale:
        raise FeatureCacheError(f"{config.feature_cache} is stale for this run: other {', '.join(stale)} "
                                f"(built for {cache.key.get('target')!r}); rebuild it with `dspark data features`")
    cache.columns(run.layer_ids)  # every layer the drafter reads is cached
    run.cache = cache
    if getattr(drafter, "reduced_vocab", False):
        if not config.init_from:
            share = choose_draft_vocab(drafter, corpus, target.tokenizer)
            if run.dist.main:
                print(f"[dspark] draft vocabulary: {drafter.config.draft_vocab_size} ids cover {share:.2%} of the "
                      "answer tokens", file=sys.stderr)
        run.target_to_draft = drafter.target_to_draft().to(run.dist.device)
        run.draft_to_target = drafter.draft_to_target().to(run.dist.device)
    return cached_examples(corpus, cache)


def choose_draft_vocab(drafter: nn.Module, corpus, tokenizer) -> float:
    """Give a reduced-vocabulary drafter the corpus's most frequent answer tokens (plus the special
    tokens, which must stay draftable); returns the share of answer tokens they cover."""
    from dspark.drafters.vocab import coverage, select_draft_vocab

    counts = token_counts(corpus, drafter.config.vocab_size)
    special = [i for i in (getattr(tokenizer, "all_special_ids", None) or []) if 0 <= i < len(counts)]
    ids = select_draft_vocab(counts, drafter.config.draft_vocab_size, always=special)
    drafter.set_draft_vocab(ids)
    return coverage(counts, ids)


#: fields that may differ between a run and its resumption
_RESUMABLE_CHANGES = {"output_dir", "save_every", "eval_every", "log_every", "keep_checkpoints", "threads",
                      "progress", "tensorboard", "save_dtype", "max_eval_sequences", "device"}


def _check_resume_config(saved: dict, config: TrainConfig, checkpoint: Path) -> None:
    current = config.to_dict()
    changed = sorted(k for k in current if k not in _RESUMABLE_CHANGES and saved.get(k) != current[k])
    if changed:
        print(f"[dspark] warning: resuming {checkpoint} with changed {', '.join(changed)}: the run will not "
              "match an uninterrupted one", file=sys.stderr)
