"""The prompts a `dspark train` run held out of its corpus, rolled out with a drafter.

Training never sees them, so they are the honest prompts for two checks that must not use the evaluation
sets: the train-vs-rollout τ comparison (`dspark eval --corpus`) and confidence calibration
(`dspark calibrate --corpus`). The split is recomputed from the corpus, the held-out fraction, the seed and
the feature cache's max_len exactly as the trainer makes it (`cached_data.heldout_samples`), and the
prompts are replayed as their exact token ids.
"""

import argparse

import torch

from dspark.eval.rollout import PromptRollout, rollout_prompt
from dspark.train.cached_data import heldout_samples
from dspark.train.corpus import load_corpus

DATASET = "heldout"


def add_heldout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", default=None,
                        help="roll out the prompts a `dspark train` run held out of this corpus (exact token ids)")
    parser.add_argument("--heldout-fraction", type=float, default=0.01, help="as the training run's")
    parser.add_argument("--split-seed", type=int, default=0, help="the training run's seed")
    parser.add_argument("--max-len", type=int, default=1024, help="the feature cache's max_len")


def add_prompt_args(parser: argparse.ArgumentParser, *, dataset_help: str, num_prompts: int) -> None:
    """The prompts a rollout command rolls out and how far: --dataset (repeatable), the held-out corpus
    prompts (`add_heldout_args`), --num-prompts per dataset and --max-new-tokens."""
    parser.add_argument("--dataset", action="append", default=[], help=dataset_help)
    add_heldout_args(parser)
    parser.add_argument("--num-prompts", type=int, default=num_prompts, help="prompts taken from each dataset")
    parser.add_argument("--max-new-tokens", type=int, default=256)


def corpus_rollouts(loaded, drafter, args: argparse.Namespace, sampling, block_size: int) -> list[PromptRollout]:
    """Rollouts of the first `args.num_prompts` held-out corpus prompts, as dataset 'heldout'."""
    corpus = load_corpus(args.corpus)
    indices = heldout_samples(corpus, args.max_len, args.heldout_fraction, args.split_seed)[: args.num_prompts]
    return [rollout_prompt(loaded, drafter, torch.from_numpy(corpus.prompt_ids(i).astype("int64")),
                           max_new_tokens=args.max_new_tokens, sampling=sampling, block_size=block_size,
                           seed=args.seed + n, dataset=DATASET) for n, i in enumerate(indices)]
