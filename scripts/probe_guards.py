"""What dynamo's guards cost per call of the compiled target step and draft block, and what skipping the guards on
nn modules saves (`python scripts/probe_guards.py [repeats]`; quiet machine, ~10 minutes of compiling).

Session 31's phase probe (`scripts/probe_round_phases.py`) found a drafting round at one request spending 4.1 ms in
the compiled draft block, whose weights take ~1.3 ms to read, and torch.profiler put "TorchDynamo Cache Lookup" at
~0.54 ms a call. Both modules hold their weights as frozen parameters, so dynamo guards every parameter of every
layer on every call. This compiles each forward twice, as `CompiledRunner` does and with
`guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe`, and times them alternately on one request
(a 1-token step, a 4-token verify, the draft block), median ms, plus the runner's own Python around the call.
"""

import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as shape_config
from probe_draft_block import one_request

from dspark.compiled import INDUCTOR_OPTIONS, CompiledDecode, CompiledRunner
from dspark.drafters.compiled_block import CompiledBlock
from dspark.ragged import Segment


def variant(module: torch.nn.Module, guard_filter) -> CompiledRunner:
    runner = CompiledRunner(module)
    if guard_filter is not None:
        runner.compiled = torch.compile(module, dynamic=True, options={"guard_filter_fn": guard_filter})
    return runner


def main(repeats: int = 40) -> None:
    drafter, backend, slot, prompt, _, state, generator = one_request(compile=True)
    anchors = torch.tensor([int(prompt[-1])])
    module = CompiledDecode(backend, backend.layer_ids).eval()
    targets = {"default": variant(module, None),
               "skip-nn": variant(module, torch.compiler.skip_guard_on_all_nn_modules_unsafe)}
    block = CompiledBlock(drafter.model).eval()
    blocks = {"default": variant(block, None),
              "skip-nn": variant(block, torch.compiler.skip_guard_on_all_nn_modules_unsafe)}

    def step(runner: CompiledRunner, n: int) -> float:
        backend.compiled = runner
        begin = time.perf_counter()
        backend.forward([Segment(slot, torch.randint(3, 10_000, (n,), generator=generator))])
        elapsed = time.perf_counter() - begin
        backend.rollback(slot, 256)
        return elapsed

    def draft(runner: CompiledRunner) -> float:
        drafter.block = runner
        begin = time.perf_counter()
        drafter._compiled_round([state.cache], anchors)
        return time.perf_counter() - begin

    cells = {f"{kind} {name}": fn for name in ("default", "skip-nn") for kind, fn in (
        ("step1", lambda name=name: step(targets[name], 1)), ("verify4", lambda name=name: step(targets[name], 4)),
        ("draft", lambda name=name: draft(blocks[name])))}
    begin = time.perf_counter()
    for fn in cells.values():  # compile every variant
        fn()
        fn()
    print(f"compiled in {time.perf_counter() - begin:.0f} s", file=sys.stderr)
    times = {key: [] for key in cells}
    for _ in range(repeats):
        for key, fn in cells.items():
            times[key].append(fn())
    for key, values in times.items():
        print(f"{key:16} {1e3 * statistics.median(values):7.3f} ms")
    empty = torch.zeros(1, dtype=torch.long)
    overhead = []
    for _ in range(200):
        begin = time.perf_counter()
        with torch.inference_mode():
            empty.clone()
        with inductor_config.patch(INDUCTOR_OPTIONS), shape_config.patch(use_duck_shape=False):
            pass
        overhead.append(time.perf_counter() - begin)
    print(f"runner's own Python (clone + config patches) {1e6 * statistics.median(overhead):.0f} us")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
