"""Compare calibration methods offline on rounds saved by scripts/calibration_rounds.py: fit sequential
temperatures (STS) and sequential Platt scaling on the held-out corpus rounds, then report, on the
evaluation rounds, the expected τ each predicts against the measured one, per sampling temperature.

    python scripts/compare_calibration.py ROUNDS.npz [--min-rounds 50] [--min-positives 20]
        [--sources code-task sharegpt] [--store DRAFTER]

--sources fits on the held-out rounds of those corpus sources only (all by default); --store writes the Platt
fit of every sampling temperature into the checkpoint DRAFTER, as `dspark calibrate` would.
"""

import argparse
import json

import numpy as np

from dspark.calibration import (
    fit_sequential_platt,
    fit_sequential_temperatures,
    pooled_report,
    prefix_survival,
    store_calibration,
)


def expected_and_measured(logits: np.ndarray, outcomes: np.ndarray, temperatures, biases=None) -> tuple[float, float]:
    """(mean 1 + Σ a_k, mean 1 + Σ y_k) over rounds: what the confidences predict and what happened."""
    survival = np.where(np.isnan(outcomes), 0.0, prefix_survival(logits, temperatures, biases))
    return float(1 + survival.sum(1).mean()), float(1 + np.nansum(outcomes, axis=1).mean())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rounds")
    parser.add_argument("--min-rounds", type=int, default=50)
    parser.add_argument("--min-positives", type=int, default=20)
    parser.add_argument("--sources", nargs="+", default=None, help="corpus sources to fit on (default: all)")
    parser.add_argument("--store", default=None, help="write the Platt fits into this DSpark checkpoint")
    args = parser.parse_args()
    data = np.load(args.rounds)
    results = []
    for temperature in (0, 1):
        if f"eval_T{temperature}_logits" not in data:
            continue
        fit_on = data[f"cal_T{temperature}_logits"], data[f"cal_T{temperature}_outcomes"]
        if args.sources:
            rows = np.isin(data[f"cal_T{temperature}_datasets"], args.sources)
            fit_on = fit_on[0][rows], fit_on[1][rows]
        guards = {"min_rounds": args.min_rounds, "min_positives": args.min_positives}
        methods = {"raw": ([1.0] * fit_on[0].shape[1], None),
                   "sts": (fit_sequential_temperatures(*fit_on, **guards), None),
                   "platt": fit_sequential_platt(*fit_on, **guards)}
        for method, (temps, biases) in methods.items():
            row = {"T": temperature, "method": method, "temperatures": [round(t, 3) for t in temps],
                   "biases": None if biases is None else [round(b, 3) for b in biases]}
            for split in ("cal", "eval"):
                logits, outcomes = data[f"{split}_T{temperature}_logits"], data[f"{split}_T{temperature}_outcomes"]
                expected, measured = expected_and_measured(logits, outcomes, temps, biases)
                pooled = pooled_report(logits, outcomes, temps, biases=biases)
                row[split] = {"rounds": len(logits), "expected_tau": round(expected, 4), "tau": round(measured, 4),
                              "error": round(expected / measured - 1, 4), "ece": pooled["ece_after"]}
                labels = data.get(f"{split}_T{temperature}_datasets")
                for name in [] if labels is None else sorted(set(labels.tolist())):
                    rows = labels == name
                    expected, measured = expected_and_measured(logits[rows], outcomes[rows], temps, biases)
                    row[split][name] = {"rounds": int(rows.sum()), "expected_tau": round(expected, 4),
                                        "tau": round(measured, 4), "error": round(expected / measured - 1, 4)}
            results.append(row)
            if method == "platt" and args.store:
                store_calibration(args.store, temps, float(temperature), biases)
            print(f"T={temperature} {method:>6}: held-out corpus (all sources) expected/measured "
                  f"{row['cal']['error']:+.1%} ECE {row['cal']['ece']:.3f} | eval {row['eval']['expected_tau']:.3f} "
                  f"vs {row['eval']['tau']:.3f} "
                  f"({row['eval']['error']:+.1%}) ECE {row['eval']['ece']:.3f}")
            for split in ("cal", "eval"):
                parts = [f"{k} {v['expected_tau']:.2f}/{v['tau']:.2f} ({v['error']:+.1%})"
                         for k, v in row[split].items() if isinstance(v, dict)]
                if parts:
                    print(f"      {split}: " + "; ".join(parts))
    summary = {"rounds": args.rounds, "sources": args.sources, "stored": args.store, "results": results}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
