"""Roll out a DSpark drafter once and keep its raw confidence logits and outcomes, so that calibration
methods can be compared offline (fit on held-out corpus rounds, judged on evaluation rounds).

    python scripts/calibration_rounds.py DRAFTER OUT.npz [--calibration-prompts 80] [--eval-prompts 10]

Writes, per sampling temperature T in {0, 1}: cal_T{T}_logits / _outcomes / _datasets (held-out corpus
prompts, 128 tokens, balanced over its sources as `training/post_run.sh` calibrates) and eval_T{T}_*
(the first N prompts of each evaluation set, 96 tokens, as `dspark eval` rolls them out).
"""

import argparse
import time

import numpy as np
import torch

from dspark.calibration import calibration_arrays
from dspark.drafters import load_drafter
from dspark.eval.datasets import dataset_name, load_prompts
from dspark.eval.rollout import all_rounds, run_rollouts
from dspark.loading import load_target
from dspark.sampling import SamplingParams
from dspark.train.cached_data import heldout_samples
from dspark.train.corpus import load_corpus
from dspark.train.heldout import corpus_rollouts, of_sources

EVAL = ["math500", "humaneval", "mbpp", "mt-bench"]
SOURCES = ["math", "code-task", "sharegpt", "code"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("drafter")
    parser.add_argument("out")
    parser.add_argument("--calibration-prompts", type=int, default=80)
    parser.add_argument("--eval-prompts", type=int, default=10)
    parser.add_argument("--eval-dir", default="../shared/eval_datasets")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_target("default", args.dtype)
    drafter = load_drafter(args.drafter, loaded.model)
    gamma = drafter.config.block_size
    prompts = [(dataset_name(f"{args.eval_dir}/{name}.jsonl"), p) for name in EVAL
               for p in load_prompts(f"{args.eval_dir}/{name}.jsonl", args.eval_prompts)]
    heldout = argparse.Namespace(corpus="corpora/smollm2-135m-instruct.safetensors", max_len=1024,
                                 heldout_fraction=0.01, split_seed=0, corpus_source=SOURCES,
                                 num_prompts=args.calibration_prompts, max_new_tokens=128, seed=0)
    corpus = load_corpus(heldout.corpus)
    sources = [corpus.sources[int(corpus.source_index[i])] for i in of_sources(
        corpus, heldout_samples(corpus, heldout.max_len, heldout.heldout_fraction, heldout.split_seed),
        SOURCES)[: heldout.num_prompts]]
    arrays = {}
    for temperature in args.temperatures:
        sampling = SamplingParams(float(temperature))
        start = time.time()
        rollouts = corpus_rollouts(loaded, drafter, heldout, sampling, gamma)
        for rollout, source in zip(rollouts, sources, strict=True):
            rollout.dataset = source
            for record in rollout.rounds:
                record.dataset = source
        save(arrays, f"cal_T{temperature:g}", all_rounds(rollouts), gamma)
        rounds = all_rounds(run_rollouts(loaded, drafter, prompts, max_new_tokens=96, sampling=sampling,
                                         block_size=gamma, seed=0))
        save(arrays, f"eval_T{temperature:g}", rounds, gamma)
        print(f"T={temperature:g}: {time.time() - start:.0f} s", flush=True)
        np.savez_compressed(args.out, **arrays)


def save(arrays: dict, prefix: str, rounds, gamma: int) -> None:
    """Logits, outcomes and each round's dataset (evaluation set, or corpus source) under `prefix`."""
    arrays[f"{prefix}_logits"], arrays[f"{prefix}_outcomes"] = calibration_arrays(rounds, gamma)
    arrays[f"{prefix}_datasets"] = np.array([r.dataset for r in rounds if r.drafted > 0])


if __name__ == "__main__":
    main()
