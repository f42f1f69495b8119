"""What the round's padded attention costs when one prompt chunk shares a round with decoding requests (session 29).

`dspark.ragged.padded_attention` runs one SDPA over (slots x longest segment x context): a 70-token prompt chunk
beside seven 1-token decode rows computes 8 x 70 query rows. This times that SDPA (bf16, 2 threads, the default
target's 9 query / 3 key-value heads of 64) against the same attention split into the decode rows and the chunk.

    python scripts/probe_padded_attention.py      # quiet machine; ~10 s
"""

import time

import torch
import torch.nn.functional as F


def per_call_ms(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1000


def case(rows: int, chunk: int, context: int) -> tuple[float, float]:
    """ms of one layer's attention for `rows - 1` decode rows and one `chunk`-token chunk: padded, then split."""
    dtype = torch.bfloat16
    keys = torch.randn(rows, 3, context, 64, dtype=dtype)
    values = torch.randn(rows, 3, context, 64, dtype=dtype)
    queries = torch.randn(rows, 9, chunk, 64, dtype=dtype)
    mask = torch.ones(rows, 1, chunk, context, dtype=torch.bool).tril(context - chunk)
    decode_q = torch.randn(rows - 1, 9, 1, 64, dtype=dtype)
    decode_mask = torch.ones(rows - 1, 1, 1, context, dtype=torch.bool)
    chunk_q = torch.randn(1, 9, chunk, 64, dtype=dtype)

    def padded() -> None:
        F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)

    def split() -> None:
        F.scaled_dot_product_attention(decode_q, keys[1:], values[1:], attn_mask=decode_mask, enable_gqa=True)
        F.scaled_dot_product_attention(chunk_q, keys[:1, :, :chunk], values[:1, :, :chunk], is_causal=True,
                                       enable_gqa=True)

    return per_call_ms(padded), per_call_ms(split)


def main(context: int = 200, layers: int = 30) -> None:
    torch.set_num_threads(2)
    for rows, chunk in ((8, 70), (4, 70), (8, 8)):
        padded, split = case(rows, chunk, context)
        print(f"{rows - 1} decode rows + a {chunk}-token chunk, context {context}: padded {padded:.3f} ms a layer "
              f"({padded * layers:.1f} ms for {layers} layers), split {split:.3f} ({split * layers:.1f}): "
              f"split / padded {split / padded:.2f}")


if __name__ == "__main__":
    main()
