"""A/B of decode-time attention: PyTorch SDPA vs `dspark.attention`'s matmul form, in `dspark bench forward`.

Runs the forward bench with each kernel, alternating twice (ABAB) in one process so both see the same
machine; prints one JSON line per run and a last JSON line with the ratios SDPA / matmul per shape.

    python scripts/attention_ab.py --dtype bfloat16 --repeats 9
"""

import argparse
import json

import dspark.attention as attention
from dspark.bench_forward import run_forward_bench


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--context-tokens", type=int, default=200)
    args = parser.parse_args()
    bench_args = argparse.Namespace(target=args.target, dtype=args.dtype, tokens=[1, 2, 4, 8, 16], rows=[8],
                                    batch_tokens=8, context_tokens=args.context_tokens, repeats=args.repeats)
    matmul_rule = attention.uses_matmul_attention
    runs = {"sdpa": [], "matmul": []}
    for _ in range(2):
        for kernel in runs:
            attention.uses_matmul_attention = matmul_rule if kernel == "matmul" else (lambda q: False)
            runs[kernel].append(run_forward_bench(bench_args))
    ratios = {}
    for index, row in enumerate(runs["sdpa"][0]["rows"]):
        sdpa = min(run["rows"][index]["ours_ms"] for run in runs["sdpa"])
        matmul = min(run["rows"][index]["ours_ms"] for run in runs["matmul"])
        ratios[f"{row['rows']}x{row['tokens']}"] = {"sdpa_ms": sdpa, "matmul_ms": matmul,
                                                     "sdpa_over_matmul": round(sdpa / matmul, 3)}
    print(json.dumps({"benchmark": "attention_ab", "dtype": args.dtype, "shapes": ratios}))


if __name__ == "__main__":
    main()
