"""The compiled drafting round with inductor's own float32 packing (MKL where a product's rows are static) against
`dspark.compiled.onednn_float32` (oneDNN), side by side in one process (session 36).

Two compiled blocks of the default drafter, one per setting, draft alternately for one request whose context grows
by two committed positions a round (the engine's usual round at c = 1: the block absorbs them in its graph).
Usage: python training/session36/draft_onednn_ab.py [ROUNDS]
"""

import copy
import statistics
import sys
import time

import torch

from dspark.compiled import CompiledRunner
from dspark.drafters import load_drafter
from dspark.drafters.compiled_block import CompiledBlock
from dspark.loading import load_target
from dspark.sampling import SamplingParams


def main(rounds: int) -> None:
    torch.set_num_threads(2)
    loaded = load_target("default", "auto")
    drafter = load_drafter("default", loaded.model)
    generator = torch.Generator().manual_seed(0)
    size = drafter.config.feature_size
    views, states, contexts = {}, {}, {}
    for onednn in (False, True):
        view = copy.copy(drafter)
        view.block = CompiledRunner(CompiledBlock(drafter.model).eval(), f"block onednn={onednn}")
        view.block.onednn_rows = 2 if onednn else None
        views[onednn] = view
        states[onednn] = view.start(torch.zeros(257, dtype=torch.long), torch.randn(256, size, generator=generator))
        contexts[onednn] = torch.randint(0, 1000, (257,), generator=generator)
    times = {False: [], True: []}
    for index in range(rounds + 5):
        for onednn in ((False, True) if index % 2 else (True, False)):
            view, state = views[onednn], states[onednn]
            start = time.perf_counter()
            draft = view.propose_batch([state], [contexts[onednn]], [7], [SamplingParams()], [None])[0]
            elapsed = time.perf_counter() - start
            if index >= 5:  # the first rounds compile
                times[onednn].append(elapsed)
            view.commit(state, torch.randn(2, size, generator=generator))
            contexts[onednn] = torch.cat([contexts[onednn], draft.tokens[:2].cpu()])
    for onednn in (False, True):
        print(f"onednn={onednn}: median {1e3 * statistics.median(times[onednn]):.2f} ms over {rounds} rounds "
              f"({views[onednn].block.failed or 'compiled'})")
    print(f"ratio oneDNN / MKL: {statistics.median(times[True]) / statistics.median(times[False]):.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
