"""`dspark bench forward`: what a forward of k new tokens costs relative to one, for our ragged forward
and for the HF forward of the same model, measured interleaved in one run.

Speculative decoding pays only when verifying γ + 1 tokens costs about as much as decoding one (the
cost model of DESIGN.md §2): the ratio `ms(k) / ms(1)` is the number that decides whether a drafter at a
given τ can win, and the ratio ours / HF at k = 1 is the framework overhead our lean forward removes.
Every (backend, k) cell is timed in a rotating order so all of them share the machine's conditions.
"""

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from dspark.loading import load_target, target_dtype_name
from dspark.ragged import RaggedBackend, Segment
from dspark.target import cache_kwarg


def _hf_step(model, cache_name: str, cache: DynamicCache, context: int, block: torch.Tensor) -> None:
    """One HF forward of `block` (rows, k) after `context` cached tokens, then the cache cropped back."""
    with torch.inference_mode():
        model(input_ids=block, **{cache_name: cache}, use_cache=True)
    cache.crop(context - cache.get_seq_length())  # negative: drop that many positions


def _ours_step(backend: RaggedBackend, context: int, block: torch.Tensor) -> None:
    backend.forward([Segment(slot, row) for slot, row in enumerate(block)])
    for slot in range(block.shape[0]):
        backend.rollback(slot, context)


def run_forward_bench(args: argparse.Namespace) -> dict:
    loaded = load_target(args.target, args.dtype)
    model = loaded.model
    generator = torch.Generator().manual_seed(0)
    vocab = min(int(model.get_output_embeddings().weight.shape[0]), 1000)
    shapes = sorted({(1, 1)} | {(1, k) for k in args.tokens} | {(r, args.batch_tokens) for r in args.rows if r > 1})
    max_rows = max(rows for rows, _ in shapes)
    context_ids = torch.randint(0, vocab, (max_rows, args.context_tokens), generator=generator)
    packed = {"auto": None, "on": True, "off": False}[args.packed_weights]
    backends = {"ours": RaggedBackend(model, max_slots=max_rows, packed_weights=packed)}
    if backends["ours"].packed_weights:  # the same forward with F.linear on the plain weights, for the ratio
        backends["ours_dense"] = RaggedBackend(model, max_slots=max_rows, packed_weights=False)
    for backend in backends.values():
        for row in context_ids:
            backend.forward([Segment(backend.allocate(), row, "none")])
    caches, cache_name = {}, cache_kwarg(model)  # looked up once: `inspect` must not sit in the timed steps
    with torch.inference_mode():
        for rows in {rows for rows, _ in shapes}:
            caches[rows] = DynamicCache(config=model.config)
            model(input_ids=context_ids[:rows], **{cache_name: caches[rows]}, use_cache=True)
    blocks = {shape: torch.randint(0, vocab, shape, generator=generator) for shape in shapes}
    cells = [(name, shape) for shape in shapes for name in (*backends, "hf")]
    times: dict = {cell: [] for cell in cells}
    for repeat in range(args.repeats + 1):  # the first pass warms up and is not counted
        order = cells[repeat % len(cells):] + cells[: repeat % len(cells)]
        for name, shape in order:
            start = time.perf_counter()
            if name in backends:
                _ours_step(backends[name], args.context_tokens, blocks[shape])
            else:
                _hf_step(model, cache_name, caches[shape[0]], args.context_tokens, blocks[shape])
            if repeat:
                times[(name, shape)].append(time.perf_counter() - start)
    return _report(args, loaded, shapes, {cell: statistics.median(t) for cell, t in times.items()}, list(backends))


def _report(args, loaded, shapes, median: dict, ours: list[str]) -> dict:
    """`ours` is our forward as the engine runs it (bf16 weights packed for oneDNN where the CPU takes them);
    `ours_dense`, when present, the same forward on the plain weights (`dspark.packed`)."""
    rows = []
    for shape in shapes:
        cell = {"rows": shape[0], "tokens": shape[1]}
        for name in (*ours, "hf"):
            cell[f"{name}_ms"] = round(1000 * median[(name, shape)], 3)
            cell[f"{name}_ratio_to_1"] = round(median[(name, shape)] / median[(name, (1, 1))], 4)
        cell["ours_over_hf"] = round(median[("ours", shape)] / median[("hf", shape)], 4)
        dense = ""
        if "ours_dense" in ours:
            cell["ours_over_dense"] = round(median[("ours", shape)] / median[("ours_dense", shape)], 4)
            dense = f", packed/plain weights {cell['ours_over_dense']:.3f}"
        rows.append(cell)
        print(f"[bench forward] {shape[0]} x {shape[1]:>2} tokens: ours {cell['ours_ms']:7.2f} ms "
              f"({cell['ours_ratio_to_1']:.3f}x one token), HF {cell['hf_ms']:7.2f} ms "
              f"({cell['hf_ratio_to_1']:.3f}x), ours/HF {cell['ours_over_hf']:.3f}{dense}", file=sys.stderr)
    verify = next((r for r in rows if r["rows"] == 1 and r["tokens"] == 8), None)
    report = {"benchmark": "forward", "target": loaded.name, "dtype": target_dtype_name(loaded.model),
              "context_tokens": args.context_tokens, "torch_threads": torch.get_num_threads(),
              "repeats": args.repeats, "packed_weights": "ours_dense" in ours, "rows": rows,
              "verify8_over_1": verify["ours_ratio_to_1"] if verify else None}
    print(json.dumps(report))
    return report
