"""Int4 weight-only targets on a CPU (`--dtype int4`): PyTorch's int4 matmul with asymmetric group-32 weights.

A batch-1 decode step of a small model reads every weight once, so its time is weight bytes: int4 reads a
quarter of bf16. Measured on a 2-core AVX512-BF16 CPU, SmolLM2-135M ragged forward over 200 cached tokens:
1 token 14.2 ms vs 33.9 ms in bf16, 8 tokens 24.2 vs 39.3 ms (docs/runtime.md). Activations stay in the
compute dtype (bf16 where native, else float32); embeddings stay dense.

This is a different model than the dense one. For the default target it is close to the original: the
target ships as a Q4_1 GGUF (asymmetric 4-bit, group 32), so its de-quantised weights re-quantise to the
same 4-bit codes; only the scales are rounded to the compute dtype. Exactness holds per dtype: greedy
speculative decoding in int4 equals vanilla decoding in int4 (tests), not dense decoding.
"""

import torch
from torch import nn

GROUP_SIZE = 32
#: PyTorch's CPU int4 packing needs N (output features) to be a multiple of this
N_MULTIPLE = 16


def quantize_weight(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per-group 4-bit codes (N, K) int32 in [0, 15] and (scale, zero) per group (K/g, N, 2) float32,
    in the kernel's convention w ≈ (code − 8)·scale + zero (zero = min + 8·scale)."""
    rows, columns = weight.shape
    grouped = weight.float().reshape(rows, columns // group_size, group_size)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((grouped - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32)
    zero = low + 8 * scale
    return codes.reshape(rows, columns), torch.stack([scale, zero], -1).transpose(0, 1).contiguous()


def dequantize(codes: torch.Tensor, scales_zeros: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """(N, K) float32 weights the codes stand for: the convention `quantize_weight` and the kernel share,
    written out (the tests check the kernel and the re-quantisation against it)."""
    rows, columns = codes.shape
    scale, zero = scales_zeros.float().transpose(0, 1).unbind(-1)  # (N, K/g) each
    grouped = codes.reshape(rows, columns // group_size, group_size).float()
    return ((grouped - 8) * scale[..., None] + zero[..., None]).reshape(rows, columns)


def can_quantize(linear: nn.Module, group_size: int = GROUP_SIZE) -> bool:
    """Whether the kernel takes this layer: a dense nn.Linear on a CPU with K % group and N % 16 both 0."""
    if not isinstance(linear, nn.Linear) or linear.weight.device.type != "cpu":
        return False
    rows, columns = linear.weight.shape
    return columns % group_size == 0 and rows % N_MULTIPLE == 0


class Int4Linear(nn.Module):
    """y = x Wᵀ + b with W held as 4-bit codes: `codes` (N, K) uint8 stay for fusing layers (q/k/v), `packed`
    is the kernel's layout. `weight`, when given, is the dense weight it was made from (the LM head's, often
    tied to the embeddings): kept so that code reading `.weight` (shapes, drafters tying to it) finds it."""

    def __init__(self, codes: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype, group_size: int = GROUP_SIZE, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        self.compute_dtype = compute_dtype
        self.register_buffer("codes", codes.to(torch.uint8), persistent=False)
        self.register_buffer("scales_zeros", scales_zeros.to(compute_dtype), persistent=False)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(compute_dtype), requires_grad=False)
        if weight is not None:
            self.weight = weight

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = GROUP_SIZE, keep_weight: bool = False) -> "Int4Linear":
        codes, scales_zeros = quantize_weight(linear.weight.detach(), group_size)
        return cls(codes, scales_zeros, linear.bias, linear.weight.dtype, group_size,
                   linear.weight if keep_weight else None)

    @classmethod
    def concat(cls, parts: list["Int4Linear"]) -> "Int4Linear":
        """One layer computing every part's outputs side by side (fused q/k/v, gate/up): codes, scales and
        biases concatenated along the output features, so the fused layer is exactly the parts."""
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([p.scales_zeros.new_zeros(p.out_features) if p.bias is None else p.bias for p in parts])
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales_zeros for p in parts], 1), bias,
                   parts[0].compute_dtype, parts[0].group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype)
        out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def quantize_int4_(model: nn.Module, group_size: int = GROUP_SIZE) -> int:
    """Replace every nn.Linear of the model (decoder layers, LM head) by an `Int4Linear`, in place; layers the
    kernel cannot take stay dense. Returns how many were replaced; marks the model as int4."""
    head = model.get_output_embeddings()
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if can_quantize(child, group_size):  # the head keeps `.weight`: drafters read its shape, tie to it
                setattr(parent, name, Int4Linear.from_linear(child, group_size, keep_weight=child is head))
                replaced += 1
    model.dspark_quantization = "int4"
    return replaced


def is_int4(model: nn.Module) -> bool:
    return getattr(model, "dspark_quantization", None) == "int4"
