"""The prompts a `dspark train` run held out of its corpus, rolled out with a drafter.

Training never sees them, so they are the honest prompts for two checks that must not use the evaluation
sets: the train-vs-rollout τ comparison (`dspark eval --corpus`) and confidence calibration
(`dspark calibrate --corpus`). The split is recomputed from the corpus, the held-out fraction, the seed and
the feature cache's max_len exactly as the trainer makes it (`cached_data.heldout_samples`), and the
prompts are replayed as their exact token ids.
"""

import argparse
import itertools

import torch

from dspark.errors import DsparkError
from dspark.eval.rollout import PromptRollout, rollout_prompt
from dspark.train.cached_data import heldout_samples
from dspark.train.corpus import load_corpus

DATASET = "heldout"


def add_heldout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", default=None,
                        help="roll out the prompts a `dspark train` run held out of this corpus (exact token ids)")
    parser.add_argument("--heldout-fraction", type=float, default=0.01, help="as the training run's")
    parser.add_argument("--split-seed", type=int, default=0, help="the training run's split_seed (its seed when unset)")
    parser.add_argument("--max-len", type=int, default=1024, help="the feature cache's max_len")
    parser.add_argument("--corpus-source", action="append", default=[], metavar="NAME",
                        help="only the held-out prompts of this corpus source (repeatable; e.g. math, code-task: "
                             "calibrate on the domains you serve)")


def add_prompt_args(parser: argparse.ArgumentParser, *, dataset_help: str, num_prompts: int) -> None:
    """The prompts a rollout command rolls out and how far: --dataset (repeatable), the held-out corpus
    prompts (`add_heldout_args`), --num-prompts per dataset and --max-new-tokens."""
    parser.add_argument("--dataset", action="append", default=[], help=dataset_help)
    add_heldout_args(parser)
    parser.add_argument("--num-prompts", type=int, default=num_prompts, help="prompts taken from each dataset")
    parser.add_argument("--max-new-tokens", type=int, default=256)


def of_sources(corpus, indices: list[int], sources: list[str]) -> list[int]:
    """The samples among `indices` whose provenance is one of `sources`, taken in turn from each source
    (so the first N are balanced across them, not the first source's); all of `indices` when empty."""
    unknown = sorted(set(sources) - set(corpus.sources))
    if unknown:
        raise DsparkError(f"corpus has no source {', '.join(unknown)} (it has {', '.join(corpus.sources)})")
    if not sources:
        return list(indices)
    groups = [[i for i in indices if corpus.sources[int(corpus.source_index[i])] == name]
              for name in dict.fromkeys(sources)]
    return [i for turn in itertools.zip_longest(*groups) for i in turn if i is not None]


def corpus_rollouts(loaded, drafter, args: argparse.Namespace, sampling, block_size: int) -> list[PromptRollout]:
    """Rollouts of the first `args.num_prompts` held-out corpus prompts, as dataset 'heldout'."""
    corpus = load_corpus(args.corpus)
    indices = heldout_samples(corpus, args.max_len, args.heldout_fraction, args.split_seed)
    indices = of_sources(corpus, indices, args.corpus_source)[: args.num_prompts]
    return [rollout_prompt(loaded, drafter, torch.from_numpy(corpus.prompt_ids(i).astype("int64")),
                           max_new_tokens=args.max_new_tokens, sampling=sampling, block_size=block_size,
                           seed=args.seed + n, dataset=DATASET) for n, i in enumerate(indices)]
