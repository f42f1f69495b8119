"""Compiled prompt chunks with the LM head on the rows they ask for (today) against every row (before, forced by
patching `logit_rows`), same process, default target, bf16. Prints median milliseconds per forward.

    python scripts/probe_prompt_logits.py
"""

import statistics
import time

import torch

from dspark import ragged
from dspark.drafters import load_drafter
from dspark.engine import make_backend
from dspark.loading import load_target
from dspark.ragged import Segment


def main() -> None:
    loaded = load_target("default", "bfloat16")
    drafter = load_drafter("default+ngram", loaded.model)
    backend = make_backend(loaded.model, drafter.target_layer_ids, max_slots=8, compile=True)
    backend.warm_up()
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    slots = [backend.allocate() for _ in range(4)]
    for slot in slots[:3]:
        backend.forward([Segment(slot, torch.randint(0, vocab, (80,), generator=generator), "last")])
    decode = [Segment(slot, torch.randint(0, vocab, (8,), generator=generator)) for slot in slots[:3]]
    prompts = {n: torch.randint(0, vocab, (n,), generator=generator) for n in (70, 300, 512)}
    cases = {f"prompt {n} alone": [Segment(slots[3], p, "last")] for n, p in prompts.items()}
    cases["3 x 8 verify + prompt 70"] = decode + [Segment(slots[3], prompts[70], "last")]
    cases["prompt 512, no logits"] = [Segment(slots[3], prompts[512], "none")]
    asked = ragged.logit_rows

    def every(segments: list[Segment], offsets: list[int], sizes: list[int]) -> list[torch.Tensor]:
        return [torch.arange(o, o + n) for o, n in zip(offsets, sizes, strict=True)]

    def timed(segments: list[Segment]) -> float:
        times = []
        for _ in range(11):
            lengths = [backend.length(s) for s in slots]
            start = time.perf_counter()
            backend.forward(segments)
            times.append(time.perf_counter() - start)
            for slot, length in zip(slots, lengths, strict=True):
                backend.rollback(slot, length)
        return 1000 * statistics.median(times)

    for rep in range(2):
        for name, segments in cases.items():
            ragged.logit_rows = every
            before = timed(segments)
            ragged.logit_rows = asked
            after = timed(segments)
            print(f"pass {rep}: {name}: every row {before:.1f} ms, rows asked for {after:.1f} ms "
                  f"({after / before:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
