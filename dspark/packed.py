"""bf16 weights reordered once into oneDNN's blocked layout, for the CPU decode forward.

`F.linear` on a plain bf16 weight hands oneDNN a row-major matrix that it reorders into its blocked layout
on every call. At the one to a few rows of a decode or verify step that reorder costs as much as the product:
on a 2-core avx512_bf16 CPU the 121 weight matmuls of one SmolLM2-135M token take about half the time with
the weight reordered once (`dspark bench forward`, docs/runtime.md). The numbers are the same kernel's, bit
for bit (tested), so the forward computes exactly what it computed with `F.linear`. The reordered copy is
extra memory (the size of the weights), so only the engine's forward (`dspark.ragged`) uses it.
"""

import torch
from torch import nn


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 weights on a CPU whose oneDNN has native bf16 kernels, with the reorder op in this torch."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x Wᵀ + b with W (out, in) bf16 reordered once for oneDNN; `x` (..., in) bf16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # batch-size hint 1: the decode layout, measured fastest at 1, 8 and 16 rows alike
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = None if bias is None else bias.detach().to(weight.dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | None:
    """A `PackedLinear` of a dense bf16 CPU weight, or None where packing is unsupported or fails (the caller
    keeps `F.linear`): an internal oneDNN op may be missing or refuse a shape in another torch build."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not packing_supported(weight.dtype, weight.device):
        return None
    try:
        packed = PackedLinear(weight, bias)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        packed(probe)
    except (RuntimeError, NotImplementedError):
        return None
    return packed
