"""Ragged batched forward for Llama-family targets (Llama, Mistral, Qwen2, Qwen3, SmolLM).

One forward runs many requests at once, each with its own cached length and its own number of new
tokens (a decode round's anchor + ℓ_r drafts, or a chunk of a prompt). Tokens are flattened into one
(N, D) batch for every matmul — where the cost is — and attention is done per request, either
looping over requests with no padding (`attention="loop"`) or in one padded call with a mask
(`attention="padded"`); `dspark bench ragged` measures which wins on a machine.

The weights are the HF model's own tensors (q/k/v and gate/up are fused into one matmul each, with
the HF parameters rebound as views of the fused tensors, so nothing is duplicated). The KV cache
holds one slot per request with its own length, so rolling a request back is setting its length.
"""

import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from dspark.errors import DsparkError
from dspark.packed import PackedLinear, affordable, pack_linear, packed_by_default
from dspark.quantize import Int4Linear
from dspark.target import TargetOutput

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
LOGITS_MODES = ("all", "last", "none")


@dataclass
class Segment:
    """New tokens of one request for one forward; `logits`: which positions need logits."""

    slot: int
    token_ids: torch.Tensor
    logits: str = "all"

    def __post_init__(self) -> None:
        if self.logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {LOGITS_MODES}, got {self.logits!r}")
        if self.token_ids.ndim != 1 or not self.token_ids.shape[0]:
            raise ValueError("a segment needs a non-empty 1-D tensor of token ids")


def supports_ragged(model: PreTrainedModel) -> bool:
    """Whether `RaggedBackend` can run this model (else the engine loops the HF adapter)."""
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "use_sliding_window", False) and getattr(config, "max_window_layers", 0):
        return False
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "layers") and hasattr(inner, "rotary_emb")


class SlotCache:
    """K/V per layer as (slots, kv_heads, capacity, head_dim); each slot has its own length.
    Capacity grows by doubling for all slots at once (one copy, amortised) and is given back by
    `reclaim` once the long requests that needed it have left."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, capacity: int = 256) -> None:
        shape = (num_slots, num_kv_heads, capacity, head_dim)
        with torch.inference_mode():  # as those `reserve` makes inside a forward: a compiled forward guards on it
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_slots
        self.initial_capacity = capacity

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, length: int) -> None:
        if length <= self.capacity:
            return
        self._resize(max(length, 2 * self.capacity))

    def reclaim(self) -> None:
        """Shrink to twice the longest slot (at least the initial capacity) once capacity is four
        times that: one long request must not pin memory for every slot after it has finished."""
        wanted = max(self.initial_capacity, 2 * max(self.lengths, default=0))
        if self.capacity >= 2 * wanted:
            self._resize(wanted)

    def _resize(self, capacity: int) -> None:
        """All new buffers are allocated before any is swapped in: an allocation that fails (out of
        memory) leaves every layer as it was, never layers of different capacity."""
        kept = min(capacity, self.capacity)
        keys = [_resized(old, capacity, kept) for old in self.keys]
        values = [_resized(old, capacity, kept) for old in self.values]
        self.keys, self.values = keys, values


@torch.inference_mode()
def _resized(old: torch.Tensor, capacity: int, kept: int) -> torch.Tensor:
    new = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
    new[:, :, :kept] = old[:, :, :kept]
    return new


class RaggedBackend:
    """The engine's backend for Llama-family models: `allocate` a slot, `forward` segments of any
    number of slots at once (one flattened batch), `rollback` a slot, `release` it."""

    def __init__(self, model: PreTrainedModel, layer_ids: Sequence[int] = (), max_slots: int = 8,
                 attention: str = "loop", packed_weights: bool | None = None,
                 attention_dtype: torch.dtype | None = None, compile: bool = False) -> None:
        if not supports_ragged(model):
            raise DsparkError(f"ragged batching supports {sorted(SUPPORTED_MODEL_TYPES)} models, "
                              f"not {getattr(model.config, 'model_type', type(model).__name__)}")
        if attention not in ("loop", "padded"):
            raise DsparkError(f"attention must be 'loop' or 'padded', got {attention!r}")
        self.model = model.eval()
        self.config = config = model.config
        self.layer_ids = tuple(layer_ids)
        self.attention = attention
        self.num_layers = int(config.num_hidden_layers)
        for layer_id in self.layer_ids:
            if not -1 <= layer_id < self.num_layers:
                raise ValueError(f"target layer id {layer_id} outside [-1, {self.num_layers - 1}]")
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        is_mistral = getattr(config, "model_type", "") == "mistral"
        self.window = getattr(config, "sliding_window", None) if is_mistral else None
        self.layers = [fuse_layer(layer, self.num_heads, self.num_kv_heads, self.head_dim)
                       for layer in model.model.layers]
        self.lm_head = model.get_output_embeddings()
        dtype = model.model.embed_tokens.weight.dtype
        if auto_packed(model) if packed_weights is None else packed_weights:
            self.layers = [_packed_layer(fused, layer, model) for fused, layer in zip(self.layers, model.model.layers,
                                                                                        strict=True)]
            if isinstance(self.lm_head, torch.nn.Linear):  # an int4 head keeps its own kernel
                head = self.lm_head
                self.lm_head = _packed(model, head.weight, head.bias, [head.weight, head.bias]) or head
        self.packed_weights = isinstance(self.layers[0].qkv, PackedLinear) if self.layers else False
        self.attention_dtype = attention_dtype or default_attention_dtype(dtype, self.device)
        self.max_slots = max_slots
        # compiled: at least two slot rows, since a dimension of size 1 is a guard (dynamo specialises 0 and 1), and
        # a one-slot engine (generate) beside a server's would compile every graph twice; the extra row is never used
        self.cache = SlotCache(self.num_layers, max(max_slots, 2) if compile else max_slots, self.num_kv_heads,
                               self.head_dim, self.attention_dtype, self.device)
        self.free = list(range(max_slots))[::-1]
        self.compiled = None  # the shared compiled forward (`dspark.compiled`), where it runs this model
        if compile:
            from dspark.compiled import compiled_decode

            self.compiled = compiled_decode(self)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    # -- slots -------------------------------------------------------------------------------------

    def allocate(self) -> int:
        if not self.free:
            raise DsparkError(f"all {self.max_slots} slots are in use")
        slot = self.free.pop()
        self.cache.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.cache.lengths[slot] = 0
        if slot not in self.free:
            self.free.append(slot)

    def length(self, slot: int) -> int:
        return self.cache.lengths[slot]

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Compile every graph the compiled forward will run before any request needs them, so a server compiles
        before it listens rather than inside its first requests' deadlines: steps of one and of two tokens for
        one request and for rounds of two (a dimension of size 1 is a guard: four graphs), on slot 0 and from
        slot 1 (no graph should depend on the slots; cheap if none does), and a prompt chunk attended apart beside
        other requests' steps (`round_layouts`: a fifth graph), the chunk on slot 1 and on slot 0. Needs an idle
        backend: it borrows slots 0-2 and leaves the free list as it found it. Returns how many steps ran compiled
        (0 without a compiled forward)."""
        if self.compiled is None:
            return 0
        if len(self.free) != self.max_slots:
            raise RuntimeError(f"warm_up needs an idle backend; {self.max_slots - len(self.free)} slots are in use")
        free, slots = list(self.free), list(range(min(3, self.max_slots)))
        self.free = [slot for slot in free if slot not in slots]
        context = self.compiled.max_tokens + 1  # a prefill longer than a compiled step: it runs eager
        rounds = [{slot: size for slot in group} for group in (slots[:1], slots[1:2], slots[:2], slots[1:3]) if group
                  for size in (1, 2)]
        if len(slots) > 1:  # a chunk beside a 2-token step
            rounds += [{slots[0]: 2, slots[1]: 2 * APART_RATIO}, {slots[1]: 2, slots[0]: 2 * APART_RATIO}]
        steps = 0
        try:
            for slot in slots:
                self.forward([Segment(slot, torch.zeros(context, dtype=torch.long), "none")])
            for sizes in rounds:
                self.forward([Segment(slot, torch.zeros(n, dtype=torch.long), "all") for slot, n in sizes.items()])
                for slot in sizes:
                    self.rollback(slot, context)
                steps += self.compiled.failed is None
        finally:
            for slot in slots:
                self.cache.lengths[slot] = 0
            self.free = free
        return steps

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first `length` cached positions of `slot` (drop rejected drafts)."""
        if not 0 <= length <= self.cache.lengths[slot]:
            raise ValueError(f"cannot roll back slot {slot} to {length}: it holds {self.cache.lengths[slot]}")
        self.cache.lengths[slot] = length

    # -- forward -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment]) -> list[TargetOutput]:
        """Run every segment after its slot's cache; returns, per segment, logits of the requested
        positions and the concatenated hidden states of `layer_ids` at every new position."""
        if len({s.slot for s in segments}) != len(segments):
            raise ValueError("one segment per slot and forward")
        starts = [self.cache.lengths[s.slot] for s in segments]
        sizes = [int(s.token_ids.shape[0]) for s in segments]
        ends = [a + n for a, n in zip(starts, sizes, strict=True)]
        if self.window and max(ends) > self.window:
            raise DsparkError(f"context of {max(ends)} tokens exceeds the sliding window {self.window}")
        compiled = self.compiled is not None and max(sizes) <= self.compiled.max_tokens  # any chunk but a long prompt's
        # compiled: room past the end, since a cache read that ends at the capacity is contiguous, one that ends
        # before it is not, and the graph would be compiled again for the other case
        self.cache.reserve(max(ends) + compiled)
        device = self.device
        tokens = torch.cat([s.token_ids.to(device) for s in segments])
        if compiled:
            positions = torch.cat([torch.arange(a, e) for a, e in zip(starts, ends, strict=True)]).to(device)
            slots = [s.slot for s in segments]
            slot_index = torch.repeat_interleave(torch.tensor(slots), torch.tensor(sizes)).to(device)
            layouts = round_layouts(slots, starts, sizes, len(self.cache.lengths), device)
            offsets = [0, *itertools.accumulate(sizes)][:-1]
            rows = logit_rows(segments, offsets, sizes)
            picked = torch.cat(rows)
            if picked.numel() < 2:  # padded with row 0: dynamo specialises a size of 0 or 1, a graph (and weights) each
                picked = torch.cat([picked, torch.zeros(2 - picked.numel(), dtype=torch.long)])
            result = self.compiled(tokens, positions, slot_index, layouts, picked.to(device), self.cache.keys,
                                   self.cache.values)
            if result is not None:  # else compiling failed (said once): the eager forward below
                for segment, end in zip(segments, ends, strict=True):
                    self.cache.lengths[segment.slot] = end
                logits, hidden = result
                return split_outputs(rows, offsets, sizes, logits, hidden)
        positions = torch.cat([torch.arange(a, e, device=device) for a, e in zip(starts, ends, strict=True)])

        inner = self.model.model
        x = inner.embed_tokens(tokens)
        cos, sin = inner.rotary_emb(x, positions[None])
        cos, sin = cos[0][:, None], half_signed(sin[0][:, None])  # (N, 1, hd): broadcast over heads
        features = {-1: x} if -1 in self.layer_ids else {}
        plan = _AttentionPlan(segments, starts, sizes, device)
        for index, layer in enumerate(self.layers):
            x = x + self._attention(layer, index, x, cos, sin, plan)
            h = rms_norm(x, layer.post_norm)
            gate, up = linear(h, layer.gate_up).chunk(2, -1)
            x = x + linear(F.silu(gate) * up, layer.down)
            if index in self.layer_ids:
                features[index] = x
        for slot, end in zip(plan.slots, ends, strict=True):
            self.cache.lengths[slot] = end

        hidden = None
        if self.layer_ids:
            if self.num_layers - 1 in features:  # HF reports the last layer's output after the final norm
                features[self.num_layers - 1] = rms_norm(features[self.num_layers - 1], inner.norm)
            hidden = torch.cat([features[i] for i in self.layer_ids], -1)
        return self._outputs(segments, plan.offsets, sizes, rms_norm(x, inner.norm), hidden)

    def _attention(self, layer: "_FusedLayer", index: int, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, plan: "_AttentionPlan") -> torch.Tensor:
        h = rms_norm(x, layer.input_norm)
        qkv = linear(h, layer.qkv, layer.qkv_bias)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if layer.q_norm is None:  # q and k sit side by side in qkv: rotate both in one pass (same arithmetic)
            qk = rotate(qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim),
                        cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = rms_norm(qkv[:, :q_size].view(-1, self.num_heads, self.head_dim), layer.q_norm)
            k = rms_norm(qkv[:, q_size : q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim), layer.k_norm)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.to(self.attention_dtype) for t in (q, k, v))  # a widening (exact) or nothing
        keys, values = self.cache.keys[index], self.cache.values[index]
        if len(plan.slots) == 1:  # a slice copy
            slot, start, size = plan.slots[0], plan.starts[0], plan.sizes[0]
            keys[slot, :, start : start + size] = k.transpose(0, 1)
            values[slot, :, start : start + size] = v.transpose(0, 1)
        else:  # every request's new rows in one indexed write, not two copies per request and layer
            keys[plan.slot_index, :, plan.position_index] = k
            values[plan.slot_index, :, plan.position_index] = v
        gqa = self.num_heads != self.num_kv_heads
        if self.attention == "padded" and len(plan.slots) > 1:
            out = plan.padded_attention(q, keys, values, gqa)
        else:
            parts = [
                F.scaled_dot_product_attention(
                    q[offset : offset + size].transpose(0, 1)[None], keys[slot : slot + 1, :, : start + size],
                    values[slot : slot + 1, :, : start + size], attn_mask=plan.causal_mask(start, size),
                    enable_gqa=gqa,
                )[0].transpose(0, 1)
                for slot, start, size, offset in plan.rows()
            ]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)  # one request: no copy
        return linear(out.reshape(out.shape[0], -1).to(x.dtype), layer.o_proj)

    def _outputs(self, segments, offsets, sizes, normed, hidden) -> list[TargetOutput]:
        rows = logit_rows(segments, offsets, sizes)
        picked = torch.cat(rows).to(normed.device)
        logits = self.lm_head(normed[picked]).float() if picked.numel() else normed.new_empty(0, self.vocab_size)
        return split_outputs(rows, offsets, sizes, logits, hidden)


def logit_rows(segments: Sequence[Segment], offsets: Sequence[int], sizes: Sequence[int]) -> list[torch.Tensor]:
    """Per segment, the flat rows of a round whose logits it asked for: all, its last (a prompt's final chunk) or
    none (an earlier chunk): the LM head is a fifth of a long prompt chunk's arithmetic."""
    rows = []
    for segment, offset, size in zip(segments, offsets, sizes, strict=True):
        if segment.logits == "all":
            rows.append(torch.arange(offset, offset + size))
        elif segment.logits == "last":
            rows.append(torch.tensor([offset + size - 1]))
        else:
            rows.append(torch.empty(0, dtype=torch.long))
    return rows


def split_outputs(rows: list[torch.Tensor], offsets: Sequence[int], sizes: Sequence[int], logits: torch.Tensor,
                  hidden: torch.Tensor | None) -> list[TargetOutput]:
    """Each segment's logits (the head's output rows in `rows` order; any past them are padding) and hidden states."""
    outputs, cursor = [], 0
    for row, offset, size in zip(rows, offsets, sizes, strict=True):
        count = int(row.numel())
        outputs.append(TargetOutput(
            logits[cursor : cursor + count],
            None if hidden is None else hidden[offset : offset + size],
        ))
        cursor += count
    return outputs


#: a fused projection: a dense weight (F.linear) or a module computing it (int4 weights, `linear`)
Weight = torch.Tensor | torch.nn.Module


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ + b for a dense weight, or the module's own forward (int4 layers carry their bias)."""
    return F.linear(x, weight, bias) if isinstance(weight, torch.Tensor) else weight(x)


@dataclass
class _FusedLayer:
    input_norm: torch.nn.Module
    post_norm: torch.nn.Module
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o_proj: Weight
    gate_up: Weight
    down: Weight
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None


def fuse_layer(layer: torch.nn.Module, num_heads: int, num_kv_heads: int, head_dim: int) -> _FusedLayer:
    """One matmul for q/k/v and one for gate/up. Dense: the HF parameters become views of the fused
    tensors, so the model still runs through HF (training features, fallbacks) and memory is shared.
    Int4 (`dspark.quantize`): one int4 layer over the parts' codes."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    norms = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if not all(isinstance(m, torch.nn.Linear) for m in [*projections, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                                        mlp.down_proj]):
        return _FusedLayer(layer.input_layernorm, layer.post_attention_layernorm, _side_by_side(projections), None,
                           attn.o_proj, _side_by_side([mlp.gate_proj, mlp.up_proj]), mlp.down_proj, *norms)
    qkv = _fused_parameter(projections, "weight")
    qkv_bias = _fused_parameter(projections, "bias") if attn.q_proj.bias is not None else None
    gate_up = _fused_parameter([mlp.gate_proj, mlp.up_proj], "weight")
    return _FusedLayer(
        layer.input_layernorm, layer.post_attention_layernorm, qkv, qkv_bias, attn.o_proj.weight.detach(),
        gate_up, mlp.down_proj.weight.detach(), *norms,
    )


def auto_packed(model: PreTrainedModel) -> bool:
    """Whether `RaggedBackend` packs this model's weights by default (`dspark.packed.packed_by_default`) and the
    reordered copy fits comfortably in memory. The SPS profile is keyed by it."""
    dtype = model.model.embed_tokens.weight.dtype
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2)
    weight = getattr(model.model.layers[0].self_attn.o_proj, "weight", None) if len(model.model.layers) else None
    smallest = None if weight is None else weight.numel()  # None: int4 layers, which are not packed anyway
    return packed_by_default(dtype, model.device, smallest) and affordable(dense_bytes)


def _packed_layer(fused: _FusedLayer, layer: torch.nn.Module, model: PreTrainedModel) -> _FusedLayer:
    """The fused layer with its dense projections reordered for oneDNN (`dspark.packed`); int4 ones stay.
    `layer` is the HF layer, whose parameters (views of the fused weights) say when those were written."""
    attn, mlp = layer.self_attn, layer.mlp

    def params(*modules: torch.nn.Module) -> list[torch.Tensor | None]:  # int4 modules may have neither
        return [getattr(m, name, None) for m in modules for name in ("weight", "bias")]

    qkv = _packed(model, fused.qkv, fused.qkv_bias, params(attn.q_proj, attn.k_proj, attn.v_proj))
    return dataclasses.replace(
        fused, qkv=qkv or fused.qkv, qkv_bias=None if qkv else fused.qkv_bias,
        o_proj=_packed(model, fused.o_proj, None, params(attn.o_proj)) or fused.o_proj,
        gate_up=_packed(model, fused.gate_up, None, params(mlp.gate_proj, mlp.up_proj)) or fused.gate_up,
        down=_packed(model, fused.down, None, params(mlp.down_proj)) or fused.down,
    )


def _packed(model: PreTrainedModel, weight: Weight, bias: torch.Tensor | None,
            sources: list[torch.Tensor | None]) -> PackedLinear | None:
    """`pack_linear(weight, bias)`, made once per weight of `model`: every backend on the model (the engine's,
    the profiler's, a benchmark's) shares one reordered copy, as they share the fused dense views. The copy
    watches `sources`, the model's own parameters behind the fused weight (a fused tensor made later over the
    same storage has a version counter of its own), and repacks itself after any in-place write to them."""
    if not isinstance(weight, torch.Tensor):
        return None
    cache = model.__dict__.setdefault("_dspark_packed", {})
    key = (weight.data_ptr(), tuple(weight.shape))
    if key not in cache:
        cache[key] = pack_linear(weight, bias, sources)
    return cache[key]


#: fused int4 layers by their first part, so every backend on one model shares one copy (as dense views do)
_FUSED_INT4: "weakref.WeakKeyDictionary[torch.nn.Module, Int4Linear]" = weakref.WeakKeyDictionary()


def _side_by_side(modules: list[torch.nn.Module]) -> torch.nn.Module:
    """One module computing every part's outputs concatenated: a fused int4 layer when all parts are int4,
    else the parts called one by one (a layer the int4 kernel could not take stays dense)."""
    if not all(isinstance(m, Int4Linear) for m in modules):
        return _Concatenated(modules)
    if modules[0] not in _FUSED_INT4:
        _FUSED_INT4[modules[0]] = Int4Linear.concat(modules)
    return _FUSED_INT4[modules[0]]


class _Concatenated(torch.nn.Module):
    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], -1)


def _fused_parameter(modules: list[torch.nn.Module], name: str) -> torch.Tensor:
    parts = [getattr(m, name) for m in modules]
    fused = _back_to_back(parts)
    if fused is not None:  # fused by an earlier RaggedBackend on the same model
        return fused
    fused = torch.cat([p.detach() for p in parts])
    cursor = 0
    for module, part in zip(modules, parts, strict=True):
        size = part.shape[0]
        setattr(module, name, torch.nn.Parameter(fused[cursor : cursor + size], requires_grad=part.requires_grad))
        cursor += size
    return fused


def _back_to_back(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over `parts` if they already lie back to back in one storage, else None."""
    storage = parts[0].untyped_storage()
    expected = parts[0].storage_offset()
    for part in parts:
        if (part.untyped_storage().data_ptr() != storage.data_ptr() or part.storage_offset() != expected
                or not part.is_contiguous()):
            return None
        expected += part.numel()
    rows = sum(p.shape[0] for p in parts)
    first = parts[0].detach()
    return first.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]))


def default_attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float32 for a bf16/fp16 model on a CPU, else the model's dtype. PyTorch's CPU attention kernel is slow on
    half-precision inputs at the few queries of a decode step (SmolLM2's shapes, 1 query x 200 keys, one
    thread on a Zen 4: bf16 229 us a layer, float32 51 us; at 2,000 keys 2,863 / 437 us), and no slower on
    float32 at 8 or 200 queries; a float32 cache is exact for the bf16 keys and values it holds and costs
    twice their memory (SmolLM2: 46 KB a token instead of 23). On a GPU the half-precision kernels are fast."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """The Llama-family RMSNorm module's result (normalised in float32, cast back, then scaled by the weight;
    bit-identical, tested) in 3 ops instead of ~7 and a module call: at batch 1 a forward's ~1,300 small ops,
    not its arithmetic, are what cost. A norm of another form runs as its own module."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        return norm(x)
    return norm.weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def half_signed(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, once per forward, for `rotate`."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention, of x (..., H, hd) with cos and signed_sin = half_signed(sin)
    broadcast over heads: HF's x·cos + rotate_half(x)·sin with the same products (negating a factor is exact), so
    the same bits, in 4 ops instead of 7 — per layer, at batch 1, ops are what cost."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class BatchLayout(NamedTuple):
    """Where some of a round's flat tokens sit in a padded (count, longest) query block: rows (n,) which flat rows
    (None: all of them, in order); batch_index / row_index (n,) each one's row of the block; mask (count, 1, longest,
    context) what each padded query sees; the block covers slots first_slot .. first_slot + count - 1 (slots in
    between that are not in the block are padding, as are rows past a segment's end: they see position 0 only, so
    no softmax is empty)."""

    rows: torch.Tensor | None
    batch_index: torch.Tensor
    row_index: torch.Tensor
    mask: torch.Tensor
    first_slot: int


def batch_layout(slots: Sequence[int], starts: Sequence[int], sizes: Sequence[int],
                 device: torch.device | str = "cpu", rows: torch.Tensor | None = None, minimum: int = 1,
                 slot_count: int | None = None) -> BatchLayout:
    """The `BatchLayout` of segments (one per slot) of `sizes` new tokens after `starts` cached ones, at flat `rows`.
    `minimum`: the block's count, longest and context are padded up to it (the range of slots stays inside
    `slot_count`), so a compiled graph sees no dimension of size 1 and is not specialised on one."""
    first = min(slots)
    count, longest = max(max(slots) - first + 1, minimum), max(max(sizes), minimum)
    if slot_count is not None and first + count > slot_count:
        first = slot_count - count
    block_starts, block_sizes = [0] * count, [1] * count
    for slot, start, size in zip(slots, starts, sizes, strict=True):
        block_starts[slot - first], block_sizes[slot - first] = start, size
    context = max(max(a + n for a, n in zip(starts, sizes, strict=True)), minimum)
    row = torch.arange(longest)
    columns = torch.arange(context)
    seen_up_to = torch.tensor(block_starts)[:, None] + row  # (count, longest)
    padding = row[None, :] >= torch.tensor(block_sizes)[:, None]
    mask = (columns <= seen_up_to[..., None]) & ~padding[..., None] | (padding[..., None] & (columns == 0))
    segment = torch.repeat_interleave(torch.arange(len(slots)), torch.tensor(list(sizes)))
    offsets = torch.tensor([0, *sizes]).cumsum(0)[:-1]
    slot_of = torch.tensor(list(slots))
    return BatchLayout(None if rows is None else rows.to(device), (slot_of - first)[segment].to(device),
                       (torch.arange(int(segment.numel())) - offsets[segment]).to(device), mask[:, None].to(device),
                       first)


#: a round's longest segment gets its own attention when it is at least this many times longer than every other:
#: padded beside the rest, a 70-token prompt chunk made each of seven decoding requests 70 query rows (session 29:
#: 25-45 ms a round over 30 layers, 5-7 ms apart; `scripts/probe_padded_attention.py`)
APART_RATIO = 4


def round_layouts(slots: Sequence[int], starts: Sequence[int], sizes: Sequence[int], slot_count: int,
                  device: torch.device | str = "cpu") -> tuple[BatchLayout, ...]:
    """The padded blocks a round's attention runs as: one over every segment, or, where one segment (a prompt chunk)
    is `APART_RATIO` times longer than every other and the others hold at least two tokens, that segment alone and
    the others in a block padded to at least 2 x 2 x 2 (one compiled graph for every such round; with one token
    beside the chunk the single block costs little more and keeps the graph count down)."""
    longest = max(range(len(sizes)), key=sizes.__getitem__)
    others = [i for i in range(len(sizes)) if i != longest]
    if not others or sizes[longest] < APART_RATIO * max(sizes[i] for i in others) or sum(sizes[i] for i in others) < 2:
        return (batch_layout(slots, starts, sizes, device),)
    offsets = [0, *itertools.accumulate(sizes)]
    rows = [torch.arange(offsets[i], offsets[i + 1]) for i in range(len(sizes))]
    return (
        batch_layout([slots[i] for i in others], [starts[i] for i in others], [sizes[i] for i in others], device,
                     torch.cat([rows[i] for i in others]), minimum=2, slot_count=slot_count),
        batch_layout([slots[longest]], [starts[longest]], [sizes[longest]], device, rows[longest]),
    )


def padded_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: BatchLayout,
                     gqa: bool) -> torch.Tensor:
    """Attention (n, H, hd) of the flat queries at `layout.rows` of q (N, H, hd) over one layer's cache (slots, H_kv,
    capacity, hd), as one SDPA over the padded block of `layout` (the slots' cache rows read as a view, no copy)."""
    if layout.rows is not None:
        q = q[layout.rows]
    count, longest, context = layout.mask.shape[0], layout.mask.shape[2], layout.mask.shape[3]
    slots = slice(layout.first_slot, layout.first_slot + count)  # a slice bound, not a guard, when compiled
    padded = q.new_zeros(count, longest, q.shape[1], q.shape[2])
    padded[layout.batch_index, layout.row_index] = q
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2), keys[slots, :, :context], values[slots, :, :context], attn_mask=layout.mask,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)[layout.batch_index, layout.row_index]


def round_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layouts: Sequence[BatchLayout],
                    gqa: bool) -> torch.Tensor:
    """Attention (N, H, hd) of a round's flat queries q (N, H, hd), one padded SDPA per block of `round_layouts`."""
    if len(layouts) == 1:
        return padded_attention(q, keys, values, layouts[0], gqa)
    out = torch.empty_like(q)
    for layout in layouts:
        out[layout.rows] = padded_attention(q, keys, values, layout, gqa)
    return out


class _AttentionPlan:
    """Where each segment sits in the flat batch and in the cache; masks built once per forward."""

    def __init__(self, segments: Sequence[Segment], starts: list[int], sizes: list[int],
                 device: torch.device) -> None:
        self.slots = [s.slot for s in segments]
        self.starts, self.sizes = starts, sizes
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.device = device
        # (N,) cache coordinates of every new row, for the one indexed cache write per layer (one request: a slice)
        if len(segments) > 1:
            self.slot_index = torch.repeat_interleave(torch.tensor(self.slots), torch.tensor(sizes)).to(device)
            self.position_index = torch.cat([torch.arange(a, a + n)
                                             for a, n in zip(starts, sizes, strict=True)]).to(device)
        self._masks: dict[tuple[int, int], torch.Tensor | None] = {}
        self._layouts: tuple[BatchLayout, ...] | None = None

    def rows(self):
        return zip(self.slots, self.starts, self.sizes, self.offsets, strict=True)

    def causal_mask(self, start: int, size: int) -> torch.Tensor | None:
        """(size, start + size) bool; None for one token (it sees the whole cache)."""
        if size == 1:
            return None
        key = (start, size)
        if key not in self._masks:
            columns = torch.arange(start + size, device=self.device)
            self._masks[key] = columns[None, :] <= start + torch.arange(size, device=self.device)[:, None]
        return self._masks[key]

    def padded_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         gqa: bool) -> torch.Tensor:
        """SDPA over the padded (count, H, longest, context) blocks of `round_layouts`: the cache rows of each
        block's slots from its lowest to its highest, read as a view."""
        if self._layouts is None:
            self._layouts = round_layouts(self.slots, self.starts, self.sizes, keys.shape[0], self.device)
        return round_attention(q, keys, values, self._layouts, gqa)
