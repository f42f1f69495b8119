"""The drafter training loop: frozen target, online features or a feature cache, AdamW, exact resumption.

One step = one global batch of `batch_size` sequences. Under `torchrun --nproc-per-node N` each rank takes
a contiguous 1/N of it and the loss is normalised by the *global* Σw (DeepSpec does the same), so the
gradient, and hence the run, is the single-process one up to float summation order. Everything random
is a function of (seed, step, position in the global batch): the data order (a seeded permutation per
epoch), the anchors (one generator per sequence), so resuming from a checkpoint replays the same steps.

What varies per drafter type lives in `train.drafter_specs`, the data in `train.examples` (online) and
`train.cached_data` (feature cache), the process group in `train.distributed`, checkpoints in
`train.checkpointing`.
"""

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dspark.errors import DsparkError
from dspark.train.anchors import anchor_seed, block_labels, candidate_anchors, target_positions
from dspark.train.cached_data import (
    CachedBatch,
    CachedExample,
    cached_examples,
    make_cached_batch,
    split_by_id,
    split_heldout,
    token_counts,
)
from dspark.train.checkpointing import (
    checkpoints,
    resolve_resume,
    restore_checkpoint,
    save_checkpoint,
    write_atomically,
)
from dspark.train.config import TrainConfig
from dspark.train.distributed import Dist, init_distributed
from dspark.train.drafter_specs import DRAFTERS, BlockForward, DrafterSpec
from dspark.train.examples import Batch, batch_indices, load_examples, make_batch
from dspark.train.feature_cache import FeatureCache, FeatureCacheError
from dspark.train.features import TargetFeatures
from dspark.train.losses import (
    LossWeights,
    block_loss,
    block_tau,
    chained_rounds,
    chunked_block_loss,
    greedy_accepts,
    position_weights,
    topk_block_loss,
)
from dspark.train.online_features import TargetFeatureSource

LOG_FILE = "train_log.jsonl"

if TYPE_CHECKING:
    from dspark.train.corpus import Corpus


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
    cache: "FeatureCache | TargetFeatureSource | None" = None  # corpus features: read, or computed per batch
    layer_ids: tuple[int, ...] = ()
    target_to_draft: torch.Tensor | None = None  # reduced draft vocabulary
    draft_to_target: torch.Tensor | None = None


def step_batch(run: Run, examples: list, step: int, first_index: int, seed: int) -> Batch | CachedBatch:
    """The local part of a global batch; first_index = position of examples[0] in the global batch."""
    seeds = [anchor_seed(seed, step, first_index + i) for i in range(len(examples))]
    return step_batch_from_seeds(run, examples, seeds)


def drafter_autocast(config: TrainConfig, device: torch.device):
    """bf16 autocast for the drafter's forward (its LM head over the whole vocabulary dominates a CPU
    step); the loss itself is computed in fp32. `auto`: only where bf16 is native (`resolve_dtype`)."""
    from dspark.loading import resolve_dtype

    dtype = config.autocast
    if dtype == "auto":
        dtype = "bfloat16" if resolve_dtype("auto", device) == torch.bfloat16 else "none"
    if dtype == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


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
    # the cached path keeps the logits in the autocast dtype: each loss chunk makes its own fp32 copy (a
    # whole-batch one is hundreds of MB, paid in page faults every step)
    confidence_logits = None if confidence_logits is None else confidence_logits.float()
    if run.cache is not None:
        out = chunked_block_loss(topk_block_loss, logits, labels, valid, confidence_logits, config.decay_lambda,
                                 normalizer, teacher=batch.teacher, weights=run.weights,
                                 target_to_draft=run.target_to_draft)
        agree = greedy_accepts(logits.detach(), batch.teacher, run.draft_to_target) & valid if greedy else None
    else:  # the full-vocabulary teacher: chunks of anchors measured slower here (bench train: online 0.65x)
        out = block_loss(logits.float(), target_logits, labels, valid, confidence_logits, run.weights,
                         config.decay_lambda, normalizer)
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


def evaluate(run: Run, drafter_forward: nn.Module, examples: list) -> dict:
    """Held-out loss terms, expected τ at T = 1 (from the acceptance probabilities 1 − TV) and, with a
    feature cache, at T = 0 (teacher-forced argmax agreement), and per-position acceptance, over all
    ranks, on fixed anchors (the first `max_eval_sequences` examples)."""
    return evaluation_metrics(run, evaluation_sums(run, drafter_forward, examples[: run.config.max_eval_sequences]))


@torch.no_grad()
def evaluation_sums(run: Run, drafter_forward: nn.Module, examples: list,
                    per_sample: dict | None = None) -> dict:
    """The sums `evaluation_metrics` divides, over all ranks: sums of disjoint example sets add up. `per_sample`
    (one process) receives each example's rollout-order sums by sample id, for paired resampling over samples."""
    config, d = run.config, run.dist
    mine = list(range(d.rank, len(examples), d.world))
    per_rank = max(config.batch_size // d.world, 1)
    gamma = config.block_size
    names = ("loss", "ce", "tv", "conf", "weight", "tau", "tau_greedy", "blocks", "chain_tokens", "chain_rounds",
             "chain_tokens_greedy", "chain_rounds_greedy", "chains_broken")
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
        for b in range(len(indices)):
            chained = chained_sums(batch.anchors[b], batch.keep[b], candidate_anchors(batch.answer_mask[b]).numel(),
                                   out.soft_label[b] * valid[b],
                                   None if greedy is None else (greedy[b] & valid[b]).float())
            for name, value in (chained or {"chains_broken": 1.0}).items():
                sums[name] += value
            if per_sample is not None and chained:
                mine_sums = per_sample.setdefault(examples[indices[b]].sample_id, {})
                for name, value in chained.items():
                    mine_sums[name] = mine_sums.get(name, 0.0) + float(value)
    sums = {name: float(value) for name, value in d.sum_fields(sums).items()}
    sums.update(accepted=d.sum(accepted), accepted_greedy=d.sum(accepted_greedy), counted=d.sum(counted))
    return sums


def evaluation_metrics(run: Run, sums: dict) -> dict:
    """The held-out metrics from `evaluation_sums`."""
    accepted, accepted_greedy, counted = sums["accepted"], sums["accepted_greedy"], sums["counted"]
    w, blocks = max(sums["weight"], 1e-6), max(sums["blocks"], 1.0)
    result = {f"eval_{n}": sums[n] / w for n in ("loss", "ce", "tv", "conf")}
    result.update(eval_tau=sums["tau"] / blocks, eval_blocks=sums["blocks"])
    result["eval_accept"] = (accepted / counted.clamp_min(1)).tolist()
    if run.cache is not None:
        result["eval_tau_greedy"] = sums["tau_greedy"] / blocks
        result["eval_accept_greedy"] = (accepted_greedy / counted.clamp_min(1)).tolist()
    if not sums["chains_broken"] and sums["chain_rounds"]:  # every answer position an anchor
        result["eval_rollout_tau"] = sums["chain_tokens"] / sums["chain_rounds"]
        if run.cache is not None:
            result["eval_rollout_tau_greedy"] = sums["chain_tokens_greedy"] / sums["chain_rounds_greedy"]
    return result


def chained_sums(anchors: torch.Tensor, keep: torch.Tensor, num_candidates: int, accept: torch.Tensor,
                 accept_greedy: torch.Tensor | None) -> dict[str, float] | None:
    """One sequence's `chained_rounds` at T = 1 (and T = 0): None unless every one of its `num_candidates`
    possible anchors is an anchor, the only case in which a rollout's path is defined."""
    order = anchors[keep].argsort()
    if len(order) == 0 or len(order) != num_candidates:
        return None
    picked = keep.nonzero().flatten()[order]
    tokens, rounds = chained_rounds(accept[picked])
    sums = {"chain_tokens": tokens, "chain_rounds": rounds}
    if accept_greedy is not None:
        tokens, rounds = chained_rounds(accept_greedy[picked])
        sums.update(chain_tokens_greedy=tokens, chain_rounds_greedy=rounds)
    return sums


def step_batch_from_seeds(run: Run, examples: list, seeds: list[int]) -> Batch | CachedBatch:
    if run.cache is not None:
        return make_cached_batch(examples, run.cache, run.layer_ids, seeds, run.config.anchors_per_seq,
                                 run.config.block_size, run.pad_id, run.dist.device)
    return make_batch(examples, seeds, run.config.anchors_per_seq, run.pad_id, run.dist.device)


@dataclass
class Setup:
    """What training and scoring share: the drafter (float32, train mode), the run state, every example."""

    spec: DrafterSpec
    drafter: nn.Module
    run: Run
    examples: list
    corpus: "Corpus | None"  # the corpus file read (None for JSONL conversations)


def setup(config: TrainConfig, d: Dist) -> Setup:
    """Load the target, build the drafter (from `init_from` / the target as configured) and open the data."""
    from dspark.loading import load_target, resolve_dtype
    from dspark.train.corpus import load_corpus

    if not d.main:
        d.barrier()  # rank 0 first: it may convert the default GGUF target once
    target = load_target(config.target, dtype=resolve_dtype(config.target_dtype, d.device), device=str(d.device))
    if d.main:
        d.barrier()

    spec = DRAFTERS[config.drafter_type]
    torch.manual_seed(config.seed)
    corpus = load_corpus(config.data) if config.reads_corpus else None
    vocab = {"draft_vocab": refreshed_draft_vocab(config, corpus, target, d)} if config.refresh_draft_vocab else {}
    drafter = spec.build(config, target.model, **vocab).to(d.device).float().train()
    layer_ids = tuple(drafter.config.target_layer_ids)
    tokenizer = target.tokenizer
    pad_id = (tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0)
    run = Run(config, d, None, loss_weights(config), pad_id, layer_ids=layer_ids)
    if config.reads_corpus:
        all_examples = open_cached_data(run, config, corpus, target, drafter)
    else:
        run.features = TargetFeatures(target.model, layer_ids)
        all_examples = load_examples(config.data, tokenizer, config.seq_len)
    return Setup(spec, drafter, run, all_examples, corpus)


def refreshed_draft_vocab(config: TrainConfig, corpus: "Corpus", target, d: Dist) -> torch.Tensor:
    """`refresh_draft_vocab`: the draft vocabulary chosen again on this run's corpus (the checkpoint's may
    have been chosen on a smaller or older one)."""
    ids, share = corpus_draft_vocab(corpus, config.draft_vocab_size, target.model.config.vocab_size, target.tokenizer)
    if d.main:
        print(f"[dspark] draft vocabulary chosen again: {len(ids)} ids cover {share:.2%} of the answer tokens",
              file=sys.stderr)
    return ids


def _prepare(config: TrainConfig) -> Dist:
    if not config.data:
        raise DsparkError("no training data: set data=PATH (JSONL of conversations)")
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    return init_distributed(config)


def train(config: TrainConfig, resume: str | Path | None = None,
          on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train a drafter as `config` says; returns the last step's metrics (and the last eval's).
    `resume`: 'latest' or a checkpoint directory. `on_step(step, metrics)` runs on every rank after each
    step (and its checkpoint)."""
    d = _prepare(config)
    output_dir = Path(config.output_dir)
    if d.main:
        output_dir.mkdir(parents=True, exist_ok=True)
    prepared = setup(config, d)
    spec, drafter, run, all_examples = prepared.spec, prepared.drafter, prepared.run, prepared.examples
    layer_ids = run.layer_ids
    train_ids, eval_ids = split_examples(config, all_examples)
    train_set = [all_examples[i] for i in train_ids]
    eval_set = [all_examples[i] for i in eval_ids]

    optimizer = build_optimizer(drafter, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    step = 0
    if resume:
        checkpoint = resolve_resume(resume, output_dir)
        step = restore_checkpoint(checkpoint, config, drafter, optimizer, scheduler, d.device)
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
    lengths = [len(example.input_ids) for example in train_set]
    metrics: dict = {}
    eval_metrics: dict = {}
    while step < config.max_steps:
        started = time.perf_counter()
        global_batch = batch_indices(len(train_set), config.batch_size, step, config.seed, lengths,
                                     config.length_grouping)
        first = d.rank * per_rank
        examples = [train_set[i] for i in global_batch[first : first + per_rank]]
        batch = step_batch(run, examples, step, first, config.seed)

        lr = scheduler.get_last_lr()[0]
        run.weights = loss_weights(config, step)
        out, valid, grad_norm = train_step(run, batch, module, drafter, optimizer)
        scheduler.step()
        step += 1

        keep = valid.any(-1)
        sums = d.sum_fields({
            "loss": out.total.detach(), "ce": out.ce, "tv": out.tv, "conf": out.conf, "accept": out.accept,
            "tau": block_tau(1 - out.soft_label, valid)[keep].sum(), "blocks": keep.sum(),
            "tokens": batch.attention_mask.sum(), "supervised": valid.sum(),
        })
        elapsed = time.perf_counter() - started
        metrics = {
            "step": step, "lr": lr,
            **{name: float(sums[name]) / d.world for name in ("loss", "ce", "tv", "conf", "accept")},
            "tau": float(sums["tau"] / sums["blocks"].clamp_min(1)), "grad_norm": float(grad_norm),
            "tokens": int(sums["tokens"]), "supervised": int(sums["supervised"]),
            "tokens_per_s": float(sums["tokens"]) / elapsed, "step_s": elapsed,
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
    d.close()
    return {**metrics, **eval_metrics}


def score(config: TrainConfig) -> dict:
    """Teacher-forced metrics (as the held-out evaluation computes them) of the drafter `init_from` on every
    sample of `data`, overall and per corpus source; no training. Two drafters scored on one corpus of the
    target's own answers read the same text, so their difference is paired: rollouts at T = 1 are not (each
    drafter's run samples its own answers, and one drafter's τ moves ~3% between seeds on 40 prompts)."""

    if not config.init_from:
        raise DsparkError("scoring needs the drafter to score: set init_from=CHECKPOINT")
    if not config.reads_corpus:
        raise DsparkError("scoring reads a corpus (.safetensors from `dspark data pack`): set data=CORPUS")
    if config.refresh_draft_vocab:
        raise DsparkError("scoring measures the checkpoint as it is: refresh_draft_vocab would choose its vocabulary "
                          "on the scored text")
    d = _prepare(config)
    if d.world > 1:
        raise DsparkError("scoring runs in one process (not under torchrun)")
    prepared = setup(config, d)
    prepared.drafter.eval()
    module = BlockForward(prepared.drafter, prepared.spec.blocks)
    corpus = prepared.corpus
    by_source: dict[str, list] = {}
    for example in prepared.examples:
        by_source.setdefault(corpus.sources[corpus.source_index[example.index]], []).append(example)
    parts, samples = {}, {}
    for source, examples in sorted(by_source.items()):
        mine: dict[str, dict] = {}
        parts[source] = evaluation_sums(prepared.run, module, examples, mine)
        samples.update({sample_id: {"source": source, **sums} for sample_id, sums in mine.items()})
    total = {name: sum(part[name] for part in parts.values()) for name in next(iter(parts.values()))}
    d.close()
    return {**evaluation_metrics(prepared.run, total),
            "sources": {source: evaluation_metrics(prepared.run, part) for source, part in parts.items()},
            "samples": samples}


def split_examples(config: TrainConfig, examples: list) -> tuple[list[int], list[int]]:
    """(training, held-out) indices of `examples`, seeded by split_seed (seed when unset): corpus samples by
    their ids (a split a growing corpus keeps), JSONL examples by their count."""
    seed = config.seed if config.split_seed is None else config.split_seed
    if config.reads_corpus:
        return split_by_id([e.sample_id for e in examples], config.heldout_fraction, seed)
    return split_heldout(len(examples), config.heldout_fraction, seed)


def open_cached_data(run: Run, config: TrainConfig, corpus: "Corpus", target,
                     drafter: nn.Module) -> list[CachedExample]:
    """The corpus's examples with the feature cache `config.feature_cache` (or, with `online_features`, the
    target computing the same per batch): refuse a cache made from another target or corpus, choose the
    reduced draft vocabulary (most frequent answer tokens) if asked."""
    from dspark.train.feature_cache import model_fingerprint

    if config.online_features:
        cache = TargetFeatureSource(target.model, corpus, config.top_k, config.seq_len, run.pad_id)
    else:
        cache = FeatureCache.open(config.feature_cache)
        expected = {"target_fingerprint": model_fingerprint(target.model), "corpus_checksum": corpus.checksum}
        stale = [name for name, value in expected.items() if cache.key.get(name) != value]
        if stale:
            raise FeatureCacheError(f"{config.feature_cache} is stale for this run: other {', '.join(stale)} "
                                    f"(built for {cache.key.get('target')!r}); rebuild it with `dspark data features`")
    cache.columns(run.layer_ids)  # every layer the drafter reads is there
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


def corpus_draft_vocab(corpus, size: int, vocab_size: int, tokenizer) -> tuple[torch.Tensor, float]:
    """The corpus's `size` most frequent answer tokens (plus the special tokens, which must stay
    draftable), ascending, and the share of its answer tokens they cover."""
    from dspark.drafters.vocab import coverage, select_draft_vocab

    counts = token_counts(corpus, vocab_size)
    special = [i for i in (getattr(tokenizer, "all_special_ids", None) or []) if 0 <= i < len(counts)]
    ids = select_draft_vocab(counts, size, always=special)
    return ids, coverage(counts, ids)


def choose_draft_vocab(drafter: nn.Module, corpus, tokenizer) -> float:
    """Give a reduced-vocabulary drafter the corpus's most frequent answer tokens; returns their coverage."""
    ids, share = corpus_draft_vocab(corpus, drafter.config.draft_vocab_size, drafter.config.vocab_size, tokenizer)
    drafter.set_draft_vocab(ids)
    return share
