"""Where the compiled draft block's time goes at one request (`python scripts/probe_draft_block.py [repeats]`).

Session 31's phase probe put the compiled block at ~4 ms of a drafting round where its weights (~25 MB in bf16) take
~1.3 ms to read, and skipping dynamo's nn-module guards saved only ~0.1 ms (`scripts/probe_guards.py`). This
compiles the block three ways, each a prefix of the last: the draft layers only (hidden), + the draft LM head (base
logits), + the sequential head's argmax chain and the confidence logits (the whole block; session 32: its chain through
the transition table, and as before with the rank-r product in every step), and the eager projection
of one committed position into the context cache (the drafter's `flush`), timed alternately on one request with a
256-token context, median ms; then torch.profiler's table of one eager block (the ops the graph is made of).
"""

import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from dspark.compiled import CompiledRunner
from dspark.drafters import load_drafter
from dspark.drafters.compiled_block import CompiledBlock, block_context
from dspark.loading import load_target
from dspark.ragged import RaggedBackend, Segment


class Layers(CompiledBlock):
    def forward(self, anchors, last_context, positions, keys, values, mask):
        model = self.model
        x = model.block_input(anchors, last_context)
        return model.block_hidden(x, positions, list(zip(keys, values, strict=True)), mask)


class LayersAndHead(CompiledBlock):
    def forward(self, anchors, last_context, positions, keys, values, mask):
        model = self.model
        x = model.block_input(anchors, last_context)
        hidden = model.block_hidden(x, positions, list(zip(keys, values, strict=True)), mask)
        return hidden, F.linear(hidden.to(self.head_weight.dtype), self.head_weight, self.head_bias)


class RankChain(CompiledBlock):
    """The whole block with the rank-r Markov product in every step of the argmax chain (before session 32)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.transition = None


def one_request(compile: bool = False) -> tuple:
    """The default target and drafter (both compiled or both eager) with one request of a random 256-token prompt
    prefilled and projected into the draft cache: (drafter, backend, slot, prompt, hidden, state, generator)."""
    loaded = load_target("default", "auto")
    drafter = load_drafter("default", loaded.model)
    drafter = drafter.compiled() if compile else drafter
    backend = RaggedBackend(loaded.model, drafter.target_layer_ids, max_slots=1, compile=compile)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 10_000, (256,), generator=generator)
    slot = backend.allocate()
    hidden = backend.forward([Segment(slot, prompt, "last")])[0].hidden
    state = drafter.start(prompt, hidden)
    drafter.flush([state])
    return drafter, backend, slot, prompt, hidden, state, generator


def main(repeats: int = 40) -> None:
    drafter, _, _, prompt, hidden, state, _ = one_request()
    model = drafter.model
    cache = state.cache
    anchors = torch.tensor([int(prompt[-1])])
    keys, values, mask = block_context([cache], len(model.layers), model.config.block_size)
    positions = cache.length + torch.arange(model.config.block_size)[None]
    last_context = cache.last_context[None]
    args = (anchors, last_context, positions, keys, values, mask)
    runners = {name: CompiledRunner(cls(model).eval(), name)
               for name, cls in (("layers", Layers), ("layers+head", LayersAndHead), ("whole block", CompiledBlock),
                                ("whole block, rank-r chain", RankChain))}
    feature = hidden[-1:]

    def flush() -> None:  # one committed position projected, then dropped again (the cache stays as it was)
        length = cache.length
        model.extend_contexts([cache], [feature])
        cache.length = length

    cells = {name: (lambda runner=runner: runner(*args)) for name, runner in runners.items()}
    planned = CompiledRunner(CompiledBlock(model).eval(), "planned")

    def with_memory_planning():  # inductor's memory planning (one pool, not an allocation per buffer)
        with inductor_config.patch(memory_planning=True):
            return planned(*args)

    cells["whole block, memory planning"] = with_memory_planning
    cells["eager flush (1 position)"] = flush
    begin = time.perf_counter()
    with torch.inference_mode():
        for fn in cells.values():
            fn()
            fn()
    print(f"compiled in {time.perf_counter() - begin:.0f} s", file=sys.stderr)
    times = {name: [] for name in cells}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, fn in cells.items():
                begin = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - begin)
    for name, values_ in times.items():
        print(f"{name:28} {1e3 * statistics.median(values_):7.3f} ms")
    eager = CompiledBlock(model).eval()
    with torch.inference_mode():
        eager(*args)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                eager(*args)
            for _ in range(5):
                flush()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
