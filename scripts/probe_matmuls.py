"""Probe (`python scripts/probe_matmuls.py [threads]`): one decode token's weight matmuls (SmolLM2-135M
shapes: 30 x [qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536] + LM head 49152x576), M = 1 and 8 rows,
for F.linear in fp32 and bf16, for bf16 weights reordered once for oneDNN (dspark.packed) and for fp32 weights
reordered likewise (batch hint 8, `RaggedBackend(packed_weights=True)`). Interleaved. On CPUs without native
bf16 the bf16 kinds are emulated (slow) and skipped with `--no-bf16`."""
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 2)
WITH_BF16 = "--no-bf16" not in sys.argv
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
weights32 = [torch.randn(o, i) * 0.02 for o, i in shapes]
weights16 = [w.bfloat16() for w in weights32]
packed16 = [torch.ops.mkldnn._reorder_linear_weight(w, 1) if WITH_BF16 else None for w in weights16]
packed16_m8 = [torch.ops.mkldnn._reorder_linear_weight(w, 8) if WITH_BF16 else None for w in weights16]
packed32 = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights32]


def run(kind: str, rows: int) -> float:
    best = []
    for _ in range(7):
        start = time.perf_counter()
        for (_, i), w32, w16, p1, p8, p32 in zip(shapes, weights32, weights16, packed16, packed16_m8, packed32,
                                                 strict=True):
            if kind == "fp32":
                F.linear(inputs32[i][:rows], w32)
            elif kind == "mkldnn_packed_fp32":
                torch.ops.mkldnn._linear_pointwise(inputs32[i][:rows], p32, None, "none", [], "")
            elif kind == "bf16":
                F.linear(inputs16[i][:rows], w16)
            else:
                torch.ops.mkldnn._linear_pointwise(inputs16[i][:rows], p1 if rows == 1 else p8, None, "none", [], "")
        best.append(time.perf_counter() - start)
    return statistics.median(best[2:])


inputs32 = {i: torch.randn(8, i) for i in (576, 1536)}
inputs16 = {i: x.bfloat16() for i, x in inputs32.items()}
if WITH_BF16:
    x = inputs16[576][:1]
    check = torch.ops.mkldnn._linear_pointwise(x, packed16[0], None, "none", [], "")
    assert torch.allclose(check.float(), F.linear(x, weights16[0]).float(), atol=1e-2, rtol=1e-2)
results = {}
for rows in (1, 8):
    for _ in range(3):
        for kind in ("fp32", "mkldnn_packed_fp32") + (("bf16", "mkldnn_packed_bf16") if WITH_BF16 else ()):
            results.setdefault(f"{kind}_m{rows}", []).append(run(kind, rows) * 1e3)
out = {k: round(statistics.median(v), 2) for k, v in results.items()}
out["bytes_MB"] = sum(o * i for o, i in shapes) * 2 / 1e6
if WITH_BF16:
    out["GBps_bf16_m1"] = round(out["bytes_MB"] / out["bf16_m1"], 1)
    out["GBps_packed_m1"] = round(out["bytes_MB"] / out["mkldnn_packed_bf16_m1"], 1)
out["GBps_fp32_m1"] = round(2 * out["bytes_MB"] / out["fp32_m1"], 1)
out["GBps_packed_fp32_m1"] = round(2 * out["bytes_MB"] / out["mkldnn_packed_fp32_m1"], 1)
print(json.dumps(out))
