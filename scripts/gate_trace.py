"""Summarise a draft-gate trace (`dspark bench load --gate-trace FILE`): per policy and number of requests, what
each mode measured over all its recorded rounds, how noisy one round is, and how often the gate switched.

    python scripts/gate_trace.py training/session17/load_free_trace.jsonl

Per row: rounds, mean tokens and ms a round, tokens/s over all its rounds (sum of tokens / sum of seconds), and
the spread of one round's tokens/s (10th-90th percentile): the noise a decision made on few rounds sees; first,
the share of each policy's round time the gate did not measure (prefills, catch-ups, lookup drafts only).
"""

import json
import statistics
import sys
from collections import defaultdict


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    rows = [json.loads(line) for line in open(sys.argv[1])]
    unmeasured: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in rows:
        if "unmeasured" in row:
            unmeasured[(row["policy"], row["unmeasured"])].append(row["seconds"])
    for policy in dict.fromkeys(row["policy"] for row in rows):
        total = sum(row["seconds"] for row in rows if row["policy"] == policy)
        shares = ", ".join(f"{reason} {len(times)} rounds {sum(times) / total:.1%}"
                           for (name, reason), times in sorted(unmeasured.items()) if name == policy)
        print(f"{policy}: {total:.1f} s in gated rounds; not measured: {shares or 'none'}")
    rows = [row for row in rows if "unmeasured" not in row]
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["policy"], row["num_requests"])].append(row)
    print(f"{'policy':<14}{'R':>3} {'mode':<6}{'rounds':>7}{'tokens':>8}{'ms':>8}{'tok/s':>8}{'p10':>8}{'p90':>8}"
          f"{'switches':>9}")
    for (policy, num_requests), group in sorted(groups.items()):
        switches = sum(a["drafted"] != b["drafted"] for a, b in zip(group, group[1:], strict=False))
        for drafted in (True, False):
            mode = [r for r in group if r["drafted"] == drafted]
            if not mode:
                continue
            rates = [r["tokens"] / r["seconds"] for r in mode]
            total = sum(r["tokens"] for r in mode) / sum(r["seconds"] for r in mode)
            print(f"{policy:<14}{num_requests:>3} {'draft' if drafted else 'plain':<6}{len(mode):>7}"
                  f"{statistics.mean(r['tokens'] for r in mode):>8.2f}"
                  f"{1000 * statistics.mean(r['seconds'] for r in mode):>8.1f}{total:>8.1f}"
                  f"{percentile(rates, 0.1):>8.1f}{percentile(rates, 0.9):>8.1f}{switches if drafted else '':>9}")


if __name__ == "__main__":
    main()
