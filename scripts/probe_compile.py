"""Probe: the batch-1 decode forward compiled whole by torch.compile (inductor) against the eager ragged forward.

One slot, n new tokens after a cached context; the compiled body is the ragged forward's arithmetic for one
request (the same fused / packed weights, float32 attention cache, cache writes inside the graph), compiled with
dynamic shapes so that a growing context does not recompile. Both arms are timed alternately over the same cache;
prints the compile time, median ms per forward and compiled/eager, then one JSON line.

    python scripts/probe_compile.py --tokens 1 8 --repeats 31 [--cpp-wrapper] [--freezing]
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from dspark.loading import load_target, resolve_dtype
from dspark.ragged import RaggedBackend, Segment, half_signed, linear, rms_norm, rotate


def make_body(backend: RaggedBackend, slot: int):
    """The one-request forward as a function of (token ids, start): logits of every new position."""
    inner = backend.model.model
    heads, kv_heads, hd = backend.num_heads, backend.num_kv_heads, backend.head_dim
    q_size, kv_size = heads * hd, kv_heads * hd
    gqa = bool(heads != kv_heads)  # a Python bool: dynamo would make a closure comparison symbolic

    def body(tokens: torch.Tensor, positions: torch.Tensor, start: int) -> torch.Tensor:
        n = tokens.shape[0]
        x = inner.embed_tokens(tokens)
        cos, sin = inner.rotary_emb(x, positions[None])
        cos, sin = cos[0][:, None], half_signed(sin[0][:, None])
        columns = torch.arange(start + n)
        mask = columns[None, :] <= start + torch.arange(n)[:, None]
        for index, layer in enumerate(backend.layers):
            h = rms_norm(x, layer.input_norm)
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            v = qkv[:, q_size + kv_size:].view(n, kv_heads, hd)
            qk = rotate(qkv[:, : q_size + kv_size].view(n, heads + kv_heads, hd), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            q, k, v = (t.to(backend.attention_dtype) for t in (q, k, v))
            keys, values = backend.cache.keys[index], backend.cache.values[index]
            keys[slot, :, start: start + n] = k.transpose(0, 1)
            values[slot, :, start: start + n] = v.transpose(0, 1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[slot: slot + 1, :, : start + n],
                                                 values[slot: slot + 1, :, : start + n], attn_mask=mask,
                                                 enable_gqa=gqa)[0].transpose(0, 1)
            x = x + linear(out.reshape(n, -1).to(x.dtype), layer.o_proj)
            h = rms_norm(x, layer.post_norm)
            gate, up = linear(h, layer.gate_up).chunk(2, -1)
            x = x + linear(F.silu(gate) * up, layer.down)
        return backend.lm_head(rms_norm(x, inner.norm)).float()

    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--cpp-wrapper", action="store_true")
    parser.add_argument("--freezing", action="store_true")
    parser.add_argument("--mode", default=None)
    parser.add_argument("--plain-weights", action="store_true",
                        help="compile over the dense weights (inductor packs them itself with --freezing)")
    args = parser.parse_args()

    import torch._inductor.config as inductor_config

    inductor_config.cpp_wrapper = args.cpp_wrapper
    inductor_config.freezing = args.freezing
    target = load_target("default", dtype=resolve_dtype(args.dtype, torch.device("cpu")))
    backend = RaggedBackend(target.model, ())
    fast_backend = RaggedBackend(target.model, (), packed_weights=False if args.plain_weights else None)
    slot = backend.allocate()
    assert fast_backend.allocate() == slot
    generator = torch.Generator().manual_seed(0)
    vocab = backend.vocab_size
    context = torch.randint(vocab, (args.context_tokens,), generator=generator)
    backend.forward([Segment(slot, context, "last")])
    fast_backend.forward([Segment(slot, context, "last")])
    base = args.context_tokens
    body = make_body(fast_backend, slot)
    compiled = torch.compile(body, dynamic=True, mode=args.mode)
    new_tokens = {n: torch.randint(vocab, (n,), generator=generator) for n in args.tokens}

    def eager(n):
        return backend.forward([Segment(slot, new_tokens[n], "all")])[0].logits

    def fast(n, start=base):
        fast_backend.cache.reserve(start + n)
        return compiled(new_tokens[n], torch.arange(start, start + n), start)

    compile_s = {}
    with torch.inference_mode():
        for n in args.tokens:
            begin = time.perf_counter()
            fast(n)
            fast(n, base + 3)  # another length: no recompilation expected
            compile_s[n] = time.perf_counter() - begin
            print(f"[probe compile] {n} tokens: compiled in {compile_s[n]:.1f} s", flush=True)
        gaps = {}
        for n in args.tokens:
            reference = eager(n)
            backend.rollback(slot, base)
            gaps[n] = float((fast(n) - reference).abs().max())
        times = {(arm, n): [] for arm in ("eager", "compiled") for n in args.tokens}
        for repeat in range(args.repeats):
            order = ("eager", "compiled") if repeat % 2 == 0 else ("compiled", "eager")
            for n in args.tokens:
                for arm in order:
                    begin = time.perf_counter()
                    eager(n) if arm == "eager" else fast(n)  # the compiled arm never advances its cache length
                    times[(arm, n)].append(time.perf_counter() - begin)
                    backend.rollback(slot, base)
    rows = []
    for n in args.tokens:
        eager_ms = statistics.median(times[("eager", n)]) * 1e3
        compiled_ms = statistics.median(times[("compiled", n)]) * 1e3
        rows.append({"tokens": n, "eager_ms": round(eager_ms, 3), "compiled_ms": round(compiled_ms, 3),
                     "compiled_over_eager": round(compiled_ms / eager_ms, 4), "compile_s": round(compile_s[n], 1),
                     "max_logit_gap": round(gaps[n], 5)})
        print(f"[probe compile] {n:2d} tokens: eager {eager_ms:7.2f} ms, compiled {compiled_ms:7.2f} ms, "
              f"compiled/eager {compiled_ms / eager_ms:.3f}, max |logit gap| {gaps[n]:.4f}", flush=True)
    print(json.dumps({"benchmark": "probe_compile", "dtype": str(target.model.dtype), "cpp_wrapper": args.cpp_wrapper,
                      "freezing": args.freezing, "mode": args.mode,
                      "plain_weights": args.plain_weights, "torch_threads": torch.get_num_threads(),
                      "repeats": args.repeats, "rows": rows}))


if __name__ == "__main__":
    main()
