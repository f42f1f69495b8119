"""Closed batches of mt-bench requests (48 tokens each) at several concurrencies, compiled target and drafter:
prompt chunks through the compiled forward (today) against the eager forward (before session 28), for no
speculation, fixed γ = 3 and dspark + gate, in one process, passes alternated. Prints medians and ratios per level.

    python scripts/probe_compiled_prefill.py 8,4,2,1 3
"""

import statistics
import sys
import time

from dspark.drafters import load_drafter
from dspark.engine import Request, make_backend
from dspark.eval.datasets import load_prompts
from dspark.factory import build_engine, step_rates
from dspark.loading import load_target
from dspark.profiling import draft_cost
from dspark.scheduler import RoundCost
from dspark.text import eos_token_ids, prompt_ids

EAGER_CHUNKS = 16  # the compiled forward's limit per request before session 28: prompt chunks ran eager
VARIANTS = {  # name: (scheduler, prompt chunks compiled)
    "none/eager-prefill": ("none", False), "dspark/eager-prefill": ("dspark", False),
    "none": ("none", True), "fixed-3": ("fixed-3", True), "dspark": ("dspark", True),
}


def main(levels: list[int], repeats: int) -> None:
    loaded = load_target("default", "bfloat16")
    drafter = load_drafter("default+ngram", loaded.model).compiled()
    prompts = [prompt_ids(loaded, t) for t in load_prompts("../shared/eval_datasets/mt-bench.jsonl", 8)]
    eos = eos_token_ids(loaded)
    verify = step_rates(loaded, "dspark", 7, 8, True, drafter.target_layer_ids)
    cost = RoundCost(verify.verify, draft_cost(loaded, drafter, 8, 7))
    backend = make_backend(loaded.model, drafter.target_layer_ids, max_slots=8, compile=True)
    backend.warm_up()
    drafter.warm_up()
    limit = backend.compiled.max_tokens  # the shared runner: every engine below uses it

    def run(name: str, level: int) -> float:
        scheduler, compiled_chunks = VARIANTS[name]
        engine = build_engine(loaded, drafter, scheduler=scheduler, block_size=7, max_concurrency=level,
                              sps=cost if scheduler == "dspark" else None, as_named=True, compile=True)
        engine.backend.compiled.max_tokens = limit if compiled_chunks else EAGER_CHUNKS
        requests = [Request(p, 48, eos_token_ids=eos) for p in prompts]
        start = time.perf_counter()
        engine.run(requests)
        return sum(len(r.output_ids) for r in requests) / (time.perf_counter() - start)

    names = list(VARIANTS)
    for name in names:  # untimed: every graph and buffer size met once
        run(name, 1), run(name, 4)
    for level in levels:
        results = {k: [] for k in names}
        for rep in range(repeats):
            for k in names[rep % len(names):] + names[:rep % len(names)]:
                results[k].append(run(k, level))
        med = {k: statistics.median(v) for k, v in results.items()}
        best = max(med["none"], med["fixed-3"])
        print(f"c={level}: " + "  ".join(f"{k} {v:.1f}" for k, v in med.items())
              + f" | dspark/best static {med['dspark'] / best:.3f}, dspark/none {med['dspark'] / med['none']:.3f}"
              + f" (eager chunks {med['dspark/eager-prefill'] / med['none/eager-prefill']:.3f}); compiled/eager"
              + f" chunks: none {med['none'] / med['none/eager-prefill']:.3f},"
              + f" dspark {med['dspark'] / med['dspark/eager-prefill']:.3f}", flush=True)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1].split(",")], int(sys.argv[2]))
