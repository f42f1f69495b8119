"""Probe (`python scripts/probe_compiled_draft.py [levels, e.g. 1,2,4,8] [repeats]`): the drafter's compiled round
against its eager one in one process. The target's forward compiled for all three variants (none, dspark + gate
with the eager drafter, dspark + gate with the compiled drafter), 8 mt-bench prompts x 48 tokens per level,
variants rotated per pass, median tokens/s of the passes."""
import statistics
import sys
import time

from dspark.drafters import load_drafter
from dspark.engine import Engine, Request, make_backend
from dspark.eval.datasets import load_prompts
from dspark.factory import step_rates
from dspark.gate import DraftGate
from dspark.loading import load_target
from dspark.profiling import draft_cost
from dspark.scheduler import RoundCost
from dspark.text import eos_token_ids, prompt_ids

levels = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1]
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
loaded = load_target("default", "bfloat16")
eager = load_drafter("default+ngram", loaded.model)
compiled = eager.compiled()
prompts = [prompt_ids(loaded, t) for t in load_prompts("../shared/eval_datasets/mt-bench.jsonl", 8)]
eos = eos_token_ids(loaded)
verify = step_rates(loaded, "dspark", 7, 8, True, eager.target_layer_ids)
costs = {"eager": RoundCost(verify.verify, draft_cost(loaded, eager, 8, 7)),
         "compiled": RoundCost(verify.verify, draft_cost(loaded, compiled, 8, 7))}
print("draft cost eager", costs["eager"].draft_seconds, "compiled", costs["compiled"].draft_seconds, flush=True)
variants = {"none": (eager, "none", None), "dspark-eager-draft": (eager, "dspark", "eager"),
            "dspark-compiled-draft": (compiled, "dspark", "compiled")}
gates = {name: DraftGate() for name in variants if name != "none"}

def run(name, level):
    drafter, scheduler, cost = variants[name]
    backend = make_backend(loaded.model, drafter.target_layer_ids, max_slots=level, compile=True)
    engine = Engine(backend, drafter, block_size=7, scheduler=scheduler, sps=costs[cost] if cost else None,
                    max_concurrency=level, gate=gates.get(name))
    requests = [Request(p, 48, eos_token_ids=eos) for p in prompts]
    start = time.perf_counter()
    engine.run(requests)
    wall = time.perf_counter() - start
    return sum(len(r.output_ids) for r in requests) / wall, engine.stats.tau

make_backend(loaded.model, eager.target_layer_ids, max_slots=8, compile=True).warm_up()  # every graph first
compiled.warm_up()
for name in variants:
    run(name, 1)
names = list(variants)
for level in levels:
    results = {n: [] for n in names}
    for rep in range(repeats):
        order = names[rep % 3:] + names[:rep % 3]
        for n in order:
            results[n].append(run(n, level))
    med = {n: statistics.median(t for t, _ in results[n]) for n in names}
    print(f"c={level}: " + "  ".join(f"{n} {med[n]:.1f} tok/s (tau {results[n][0][1]:.2f})" for n in names)
          + f"  compiled/eager draft {med['dspark-compiled-draft'] / med['dspark-eager-draft']:.3f}"
          + f"  dspark-compiled/none {med['dspark-compiled-draft'] / med['none']:.3f}"
          + f"  dspark-eager/none {med['dspark-eager-draft'] / med['none']:.3f}", flush=True)
