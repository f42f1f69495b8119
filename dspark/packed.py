"""Weights reordered once into oneDNN's blocked layout, for the CPU decode and drafting forwards: bf16, and
float32 on CPUs without native bf16 (`packed_by_default`).

`F.linear` on a plain bf16 weight hands oneDNN a row-major matrix that it reorders into its blocked layout
on every call. At the one to a few rows of a decode, verify or draft step that reorder costs as much as the
product: on a 2-core avx512_bf16 CPU the 121 weight matmuls of one SmolLM2-135M token take about half the
time with the weight reordered once (`dspark bench forward`, docs/runtime.md). The numbers are the same
kernel's, bit for bit (tested), so a bf16 forward computes exactly what it computed with `F.linear`.

The reordered copy is extra memory (the size of the weights) and carries no gradient: `PackedLinear` keeps
the dense weight as its parameter (same state dict as `nn.Linear`) and uses the copy only when no gradient
is being recorded, so a packed module still trains correctly, and only through `F.linear`.
"""

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

#: the most of the machine's memory an automatic packing may add (the reordered copy is the weights' size)
MAX_MEMORY_SHARE = 0.25


def affordable(num_bytes: int) -> bool:
    """Whether a reordered copy of `num_bytes` of weights fits in MAX_MEMORY_SHARE of physical memory: a
    135M model's 270 MB does anywhere, a 7B model's 14 GB does not on a 32 GB machine."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return num_bytes <= MAX_MEMORY_SHARE * total


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` can be reordered for oneDNN here (the reorder op in this torch, on a CPU): bf16
    where oneDNN has native bf16 kernels, float32 wherever oneDNN runs."""
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


#: float32 matrices smaller than this stay F.linear by default: oneDNN's per-call overhead made a test-sized model's
#: forward (32-wide layers) 1.6x slower packed, while SmolLM2-135M's smallest matrix (576 x 576) gains.
MIN_FLOAT32_ELEMENTS = 1 << 18


def packed_by_default(dtype: torch.dtype, device: torch.device, numel: int | None = None) -> bool:
    """bf16 wherever it can be packed; float32 on CPUs whose oneDNN has no native bf16 (where `auto` runs
    float32). There packed float32, oneDNN's kernel instead of F.linear's (MKL), measured 0.89x the time of a
    one-token forward and 0.56x of an 8-token one on a 2-core AVX2 CPU (docs/runtime.md, session 12), and a row's
    result does not depend on the rows beside it. It is not bit-identical to F.linear (HF's float32 forward),
    so its greedy output may leave HF's at a near-tie; the real-model tests still hold it to HF's. On CPUs with
    native bf16 float32 is not the default dtype and packing it is not measured: an opt-in
    (`RaggedBackend(packed_weights=True)`, `dspark bench forward --packed-weights on`). `numel`: the matrix
    size; small float32 matrices are not worth it (MIN_FLOAT32_ELEMENTS)."""
    if dtype == torch.float32:
        return (packing_supported(dtype, device) and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
                and (numel is None or numel >= MIN_FLOAT32_ELEMENTS))
    return dtype == torch.bfloat16 and packing_supported(dtype, device)


class PackedLinear(nn.Module):
    """y = x Wᵀ + b with W (out, in) bf16 or float32, reordered once for oneDNN; `x` (..., in) of W's dtype.
    `weight` / `bias` are the dense tensors (shared, not copied), so the state dict is an `nn.Linear`'s."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 watched: Sequence[torch.Tensor | None] = ()) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight.detach(),
                                                                                 requires_grad=False)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(
            bias.detach(), requires_grad=False)
        # what an in-place write would move: the dense tensors, or the caller's own parameters behind them
        self.watched = [t for t in watched if t is not None] or [t for t in (self.weight, self.bias) if t is not None]
        self._pack()

    def _pack(self) -> None:
        # batch-size hint: bf16 1 (the decode layout, measured fastest at 1, 8 and 16 rows alike on an AMX CPU);
        # float32 8 (on an AVX2 CPU hint 1 made 8-row products 1.4x slower and one-row ones no faster)
        hint = 1 if self.weight.dtype == torch.bfloat16 else 8
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous(), hint)
        self.packed_bias = None if self.bias is None else self.bias.detach().to(self.weight.dtype).contiguous()
        self.packed_version = self._version()

    def _version(self) -> tuple[int, ...]:
        """The watched tensors' version counters: they move with every in-place write (an optimiser step)."""
        return tuple(t._version for t in self.watched)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)  # training: the dense weight, with its gradient
        if self._version() != self.packed_version:  # written since it was packed: never a stale copy
            with torch.inference_mode(False), torch.no_grad():
                self._pack()
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.packed_bias, "none", [], "")


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                watched: Sequence[torch.Tensor | None] = ()) -> PackedLinear | None:
    """A `PackedLinear` of a dense bf16 CPU weight, or None where packing is unsupported or fails (the caller
    keeps `F.linear`): an internal oneDNN op may be missing or refuse a shape in another torch build."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not packing_supported(weight.dtype, weight.device):
        return None
    try:
        packed = PackedLinear(weight, bias, watched)
        with torch.no_grad():
            packed(torch.zeros(1, weight.shape[1], dtype=weight.dtype))
    except (RuntimeError, NotImplementedError):
        return None
    return packed


def pack_linears(module: nn.Module) -> int:
    """Replace every CPU `nn.Linear` inside `module` that `packed_by_default` packs by its `PackedLinear` (same
    parameters, same state dict keys); returns how many were packed. For drafters, whose matmuls run at a few
    rows per round. Pack after loading weights: a later `load_state_dict` would update the dense weight, not the
    packed copy."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and packed_by_default(child.weight.dtype, child.weight.device,
                                                               child.weight.numel()):
                packed = pack_linear(child.weight, child.bias)
                if packed is not None:
                    setattr(parent, name, packed)
                    count += 1
    return count
