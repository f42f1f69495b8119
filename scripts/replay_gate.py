"""Replay a draft-gate trace (`dspark bench load --gate-trace FILE`) through `DraftGate` with rounds drawn at random
from the measured ones: what the gate reaches when one mode's round times do not drift, against each mode alone.

Session 29 blamed part of the c = 8 loss on the gate's retries (a retried mode's one new round weighs ~80% of its
average). If the gate, fed i.i.d. rounds of the very same measured distributions, ends near the better mode, its
rule is not what loses; drift between the rounds (prompt chunks, longer contexts) is.

    python scripts/replay_gate.py training/session29/load_n16.trace.jsonl [rounds] [seeds]
"""

import json
import random
import statistics
import sys

from dspark.gate import DraftGate


def throughput(rounds: list[tuple[float, float]]) -> float:
    return sum(t for t, _ in rounds) / sum(s for _, s in rounds) if rounds else 0.0


def replay(draft: list[tuple[float, float]], plain: list[tuple[float, float]], requests: int, length: int,
           seed: int) -> tuple[float, float]:
    """Tokens/s and drafting share of `length` rounds at `requests` running requests, the gate choosing each."""
    rng, gate = random.Random(seed), DraftGate()
    tokens = seconds = drafted = 0.0
    for _ in range(length):
        mode = gate.should_draft(requests)
        t, s = rng.choice(draft if mode else plain)
        gate.record(requests, mode, t, s)
        tokens, seconds, drafted = tokens + t, seconds + s, drafted + mode
    return tokens / seconds, drafted / length


def main(path: str, length: int = 400, seeds: int = 20) -> None:
    rows = [json.loads(line) for line in open(path)]
    print("c  R  rounds draft/plain  draft tok/s  plain tok/s  gate tok/s (share drafted)  gate / better")
    for concurrency in sorted({r["concurrency"] for r in rows if r["policy"] == "dspark"}):
        measured = [r for r in rows if r["policy"] == "dspark" and r["concurrency"] == concurrency
                    and r["num_requests"] == concurrency and "tokens" in r]
        draft = [(r["tokens"], r["seconds"]) for r in measured if r["drafted"]]
        plain = [(r["tokens"], r["seconds"]) for r in measured if not r["drafted"]]
        if not draft or not plain:
            continue
        results = [replay(draft, plain, concurrency, length, seed) for seed in range(seeds)]
        gate = statistics.mean(r[0] for r in results)
        share = statistics.mean(r[1] for r in results)
        better = max(throughput(draft), throughput(plain))
        print(f"{concurrency:<2} {concurrency:<2} {len(draft):>6}/{len(plain):<6} {throughput(draft):>12.1f} "
              f"{throughput(plain):>12.1f} {gate:>11.1f} ({share:.2f}) {gate / better:>18.3f}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
