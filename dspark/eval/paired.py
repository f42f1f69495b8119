"""Paired comparison of two drafters scored on the same text (`dspark train --score`), with a bootstrap over
samples. Why: at ~0.5% differences, a 10-prompt rollout cannot rank drafters, but two teacher-forced scores of one
shared answer set are paired sample by sample, so resampling the samples gives an interval for the ratio.

    python -m dspark.eval.paired BASE_SCORE.json OTHER_SCORE.json [--temperature 1]
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

KEYS = {0.0: ("chain_tokens_greedy", "chain_rounds_greedy"), 1.0: ("chain_tokens", "chain_rounds")}


def paired_ratio(base: dict[str, dict], other: dict[str, dict], tokens_key: str, rounds_key: str,
                 resamples: int = 4000, seed: int = 0) -> dict:
    """Rollout-order τ (tokens / rounds summed over samples) of `other` over `base` on their common samples, with
    a 95% percentile interval from resampling the samples (both drafters take the same draw) and the fraction of
    draws where `other` is ahead."""
    common = sorted(set(base) & set(other))
    if not common:
        raise ValueError("the two scores share no sample: score both drafters on the same corpus")
    table = np.array([[base[i][tokens_key], base[i][rounds_key], other[i][tokens_key], other[i][rounds_key]]
                      for i in common], dtype=np.float64)

    def ratio(rows: np.ndarray) -> np.ndarray:
        sums = rows.sum(axis=-2)
        return (sums[..., 2] / sums[..., 3]) / (sums[..., 0] / sums[..., 1])

    draws = np.random.default_rng(seed).integers(0, len(common), size=(resamples, len(common)))
    resampled = ratio(table[draws])
    low, high = np.percentile(resampled, [2.5, 97.5])
    sums = table.sum(axis=0)
    return {"samples": len(common), "base_tau": sums[0] / sums[1], "other_tau": sums[2] / sums[3],
            "ratio": float(ratio(table)), "ci95": [float(low), float(high)],
            "p_other_ahead": float((resampled > 1).mean())}


def compare(base_score: dict, other_score: dict, temperature: float = 0.0, **kwargs) -> dict:
    """`paired_ratio` overall and per source of two `dspark train --score` outputs."""
    tokens_key, rounds_key = KEYS[temperature]
    base, other = base_score["samples"], other_score["samples"]
    result = {"all": paired_ratio(base, other, tokens_key, rounds_key, **kwargs)}
    for source in sorted({sample["source"] for sample in base.values()}):
        pick = {i for i, sample in base.items() if sample["source"] == source}
        result[source] = paired_ratio({i: base[i] for i in pick}, {i: other[i] for i in pick if i in other},
                                      tokens_key, rounds_key, **kwargs)
    return result


def read_score(path: str | Path) -> dict:
    """The last line of a `dspark train --score` output (earlier lines are progress)."""
    lines = Path(path).read_text().strip().splitlines()
    if not lines:
        raise ValueError(f"{path}: empty")
    score = json.loads(lines[-1])
    if "samples" not in score:
        raise ValueError(f"{path}: no per-sample sums (scored before session 35?): score the drafter again")
    return score


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base")
    parser.add_argument("other")
    parser.add_argument("--temperature", type=float, choices=sorted(KEYS), default=0.0,
                        help="0: the greedy rollout order (T = 0 scores); 1: the expected one at T = 1")
    parser.add_argument("--resamples", type=int, default=4000)
    args = parser.parse_args(argv)
    try:
        result = compare(read_score(args.base), read_score(args.other), args.temperature, resamples=args.resamples)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for name, row in result.items():
        print(f"{name:12s} {row['samples']:5d} samples  tau {row['base_tau']:.4f} -> {row['other_tau']:.4f}  "
              f"ratio {row['ratio']:.4f} [{row['ci95'][0]:.4f}, {row['ci95'][1]:.4f}]  "
              f"P(other ahead) {row['p_other_ahead']:.3f}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
