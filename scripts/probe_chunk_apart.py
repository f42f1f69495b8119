"""A prompt chunk attended apart from the decoding requests beside it (`dspark.ragged.round_layouts`, session 30)
against the one padded block of session 29, in the compiled forward of the default target, one process, alternated.

Session 29's load run found rounds that admit a refill prompt beside seven decoding requests taking 93-118 ms against
29.5 ms for a plain round of eight: the padded block made every decoding row as many query rows as the chunk. This
times such rounds both ways (`APART_RATIO` set out of reach for the old layout), with decode steps of 1 and of 4
tokens beside a chunk of 70, and a plain round of 8 x 1 for scale.

    python scripts/probe_chunk_apart.py      # quiet machine; compiles 5 graphs first (~5-10 minutes on 2 cores)
"""

import statistics
import sys
import time

import torch

import dspark.ragged as ragged
from dspark.loading import load_target
from dspark.ragged import RaggedBackend, Segment


def main(context: int = 200, chunk: int = 70, repeats: int = 15) -> None:
    model = load_target(dtype="auto").model
    backend = RaggedBackend(model, max_slots=8, compile=True)
    start = time.perf_counter()
    backend.warm_up()
    print(f"warm-up {time.perf_counter() - start:.0f} s", file=sys.stderr)
    generator = torch.Generator().manual_seed(0)
    slots = [backend.allocate() for _ in range(8)]
    for slot in slots[:7]:
        backend.forward([Segment(slot, torch.randint(3, 10_000, (context,), generator=generator), "none")])
    prompt = torch.randint(3, 10_000, (chunk,), generator=generator)

    def round_ms(step: int, with_chunk: bool) -> float:
        segments = [Segment(slot, torch.randint(3, 10_000, (step,), generator=generator)) for slot in slots[:7]]
        segments.append(Segment(slots[7], prompt, "last") if with_chunk else Segment(slots[7], prompt[:1]))
        begin = time.perf_counter()
        backend.forward(segments)
        elapsed = time.perf_counter() - begin
        for slot in slots[:7]:
            backend.rollback(slot, context)
        backend.rollback(slots[7], 0)
        return 1000 * elapsed

    cells = {(name, step): [] for name in ("apart", "padded") for step in (1, 4)}
    plain = []
    for repeat in range(repeats + 1):  # the first pass compiles anything the warm-up missed and is not counted
        for (name, step), times in cells.items():
            ragged.APART_RATIO = 4 if name == "apart" else 10**9
            ms = round_ms(step, True)
            if repeat:
                times.append(ms)
        ms = round_ms(1, False)
        if repeat:
            plain.append(ms)
    ragged.APART_RATIO = 4
    median = {cell: statistics.median(times) for cell, times in cells.items()}
    for step in (1, 4):
        print(f"7 requests x {step} token(s) + a {chunk}-token chunk, context {context}: padded "
              f"{median[('padded', step)]:.1f} ms, apart {median[('apart', step)]:.1f} ms "
              f"(apart / padded {median[('apart', step)] / median[('padded', step)]:.3f})")
    print(f"plain round of 8 x 1: {statistics.median(plain):.1f} ms; compile failure: {backend.compiled.failed}")


if __name__ == "__main__":
    main(repeats=int(sys.argv[1]) if len(sys.argv) > 1 else 15)
