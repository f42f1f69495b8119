"""The target's compiled one-request forward with 1-row products MKL's (inductor's choice, `ONEDNN_MIN_ROWS` = 2)
against oneDNN's (min rows 1), side by side in one process (session 36): decode steps (1 token) and verify steps
(4 and 8 tokens, symbolic rows: oneDNN either way) on a 256-token context, alternating.
Usage: python training/session36/decode_onednn_ab.py [STEPS]
"""

import statistics
import sys
import time

import torch

from dspark.compiled import CompiledDecode, CompiledRunner
from dspark.engine import make_backend
from dspark.loading import load_target
from dspark.ragged import Segment


def main(steps: int) -> None:
    torch.set_num_threads(2)
    loaded = load_target("default", "auto")
    layer_ids = (1, 15, 28)
    backends = {}
    for rows in (2, 1):
        backend = make_backend(loaded.model, layer_ids, max_slots=1, compile=True)
        backend.compiled = CompiledRunner(CompiledDecode(backend, layer_ids).eval(), f"decode rows>={rows}")
        backend.compiled.onednn_rows = rows
        slot = backend.allocate()
        backend.forward([Segment(slot, torch.randint(0, 1000, (256,)), "last")])
        backends[rows] = (backend, slot)
    times = {(rows, n): [] for rows in (2, 1) for n in (1, 4, 8)}
    with torch.inference_mode():
        for index in range(steps + 3):
            for n in (1, 4, 8):
                for rows in ((2, 1) if index % 2 else (1, 2)):
                    backend, slot = backends[rows]
                    length = backend.length(slot)
                    start = time.perf_counter()
                    backend.forward([Segment(slot, torch.randint(0, 1000, (n,)))])
                    elapsed = time.perf_counter() - start
                    backend.rollback(slot, length)
                    if index >= 3:
                        times[(rows, n)].append(elapsed)
    for n in (1, 4, 8):
        mkl, onednn = (statistics.median(times[(rows, n)]) for rows in (2, 1))
        print(f"{n} tokens: 1-row MKL {1e3 * mkl:.2f} ms, 1-row oneDNN {1e3 * onednn:.2f} ms, ratio {onednn / mkl:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
