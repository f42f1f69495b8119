"""A/B of the ragged forward: `dspark/ragged.py` at a git revision against the working tree, in one process.

Both backends wrap the same loaded target (the fused weights are views of the same parameters); their forwards
are timed alternately over the same cached context, so machine noise hits both alike. Prints the median time per
forward for each arm and tokens-per-forward, and the new/old ratio, then one JSON line.

    python scripts/ab_forward.py --old-rev HEAD --tokens 1 8 --repeats 31
"""

import argparse
import importlib.util
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from dspark import ragged
from dspark.loading import load_target, resolve_dtype

REPO = Path(__file__).resolve().parents[1]


def module_at(rev: str):
    """dspark/ragged.py as it was at `rev`, imported as a separate module."""
    source = subprocess.check_output(["git", "show", f"{rev}:dspark/ragged.py"], cwd=REPO, text=True)
    spec = importlib.util.spec_from_loader("ragged_at_rev", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"ragged@{rev}", "exec"), module.__dict__)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-rev", default="HEAD")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--layer-ids", type=int, nargs="*", default=[1, 8, 14, 21, 27],
                        help="target features returned (the shipped drafter's layers)")
    args = parser.parse_args()

    target = load_target("default", dtype=resolve_dtype(args.dtype, torch.device("cpu")))
    old_module = module_at(args.old_rev)
    arms = {"old": old_module.RaggedBackend(target.model, args.layer_ids),
            "new": ragged.RaggedBackend(target.model, args.layer_ids)}
    segment = {"old": old_module.Segment, "new": ragged.Segment}
    generator = torch.Generator().manual_seed(0)
    vocab = arms["new"].vocab_size
    context = torch.randint(vocab, (args.context_tokens,), generator=generator)
    slots = {}
    for name, backend in arms.items():
        slots[name] = backend.allocate()
        backend.forward([segment[name](slots[name], context, "last")])
    new_tokens = {n: torch.randint(vocab, (n,), generator=generator) for n in args.tokens}

    check = {name: arms[name].forward([segment[name](slots[name], new_tokens[args.tokens[-1]], "all")])[0].logits
             for name in arms}
    for name in arms:
        arms[name].rollback(slots[name], args.context_tokens)
    identical = torch.equal(check["old"], check["new"])

    times = {(name, n): [] for name in arms for n in args.tokens}
    for repeat in range(args.repeats):
        order = list(arms) if repeat % 2 == 0 else list(arms)[::-1]
        for n in args.tokens:
            for name in order:
                backend = arms[name]
                start = time.perf_counter()
                backend.forward([segment[name](slots[name], new_tokens[n], "all")])
                times[(name, n)].append(time.perf_counter() - start)
                backend.rollback(slots[name], args.context_tokens)
    rows = []
    for n in args.tokens:
        old_ms = statistics.median(times[("old", n)]) * 1e3
        new_ms = statistics.median(times[("new", n)]) * 1e3
        rows.append({"tokens": n, "old_ms": round(old_ms, 3), "new_ms": round(new_ms, 3),
                     "new_over_old": round(new_ms / old_ms, 4)})
        print(f"[ab forward] {n:2d} tokens: old {old_ms:7.2f} ms, new {new_ms:7.2f} ms, new/old {new_ms / old_ms:.3f}")
    print(json.dumps({"benchmark": "ab_forward", "old_rev": args.old_rev, "dtype": str(target.model.dtype),
                      "torch_threads": torch.get_num_threads(), "repeats": args.repeats,
                      "logits_identical": identical, "rows": rows}))


if __name__ == "__main__":
    main()
