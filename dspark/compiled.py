"""The decode / verify forward compiled whole by `torch.compile` (opt-in: `--compile`).

At batch 1 an eager forward of SmolLM2-135M dispatches ~1,000 small ops around its 121 matmuls; on a 2-core CPU
they cost a third of a step (docs/runtime.md, session 23). Inductor fuses them into a few C++ loops, and two
settings make that pay: `cpp_wrapper` (the graph is driven from C++, not from Python, which otherwise gives the
gain back) and `freezing` with the weights as module *parameters* (inductor then folds them as constants and
reorders them once for oneDNN itself, as `dspark.packed` does eagerly; weights captured any other way stay
plain and their matmuls get slower).

`CompiledDecode` is the ragged forward's arithmetic for a round of decode, verify and prompt segments, one request's or
several (`dspark.ragged.RaggedBackend`), reading and writing the backend's own slot cache, so eager and compiled
forwards can alternate on one slot (prompt chunks longer than `MAX_COMPILED_TOKENS` run eager). Attention is padded
(`padded_attention`: one SDPA over the round's slot range read as a view; a prompt chunk much longer than the round's
other segments in an SDPA of its own, `round_layouts`) and the cache is written through tensor indices, so no slot,
context length or step size is a guard: five graphs, since dynamic shapes specialise size 1 (one token or more per
request, one request or more; a chunk apart, its neighbours padded to no dimension of 1). Weights are frozen at the
first call: for inference only; a model whose weights are written afterwards needs a new backend.

Not bit-identical to the eager forward (fused kernels round bf16 differently), so speculative decoding is exact
against vanilla decoding *with the same compiled forward*, as the eager bf16 forward is (see docs/runtime.md,
"Exactness per dtype").
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as shape_config
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from dspark.loading import log
from dspark.packed import packed_by_default
from dspark.ragged import BatchLayout, half_signed, rms_norm, rotate, round_attention

#: the most new tokens per request a compiled forward takes: decode and verify steps, and prompt chunks up to the
#: engine's default chunk (longer ones run eager). Compiled, a 70-token prompt chunk beside three 8-token verify
#: segments took 63 ms against 89 eager, the chunk alone 44 against 76 (session 28, default target, bf16): a round
#: that admits a request no longer drops the whole batch to the eager forward
MAX_COMPILED_TOKENS = 512
#: inductor settings for the compile (see the module docstring for why each)
INDUCTOR_OPTIONS = {"cpp_wrapper": True, "freezing": True}
#: compiled float32 products of at least this many static rows go to oneDNN on CPUs without native bf16
#: (`onednn_float32`): every one, since the 1-token decode graph took 0.86x the time with oneDNN there too
ONEDNN_MIN_ROWS = 1


class _CacheTag(CustomGraphPass):
    """A pass that changes nothing but inductor's cache key: a graph compiled under `onednn_float32` and one
    compiled without it (by another dspark, or in another process here) are different files."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return self.tag


@contextmanager
def onednn_float32(min_rows: int | None) -> Iterator[None]:
    """Inductor packs a frozen float32 weight for MKL's packed GEMM where the product's row count is static and
    for oneDNN where it is symbolic. On a 2-core AVX2 CPU (AMD EPYC, session 36) MKL's packed GEMM took ~2.6x
    oneDNN's time on the default target's 49k-wide LM head at 8 rows and ~1.6x on its layers' matrices at 2 to 8
    rows: a drafter's block (7 static rows) paid MKL's, and so did the 1-token decode graph (0.86x the time with
    oneDNN, side by side), while the verify graph (symbolic rows) had oneDNN's. Inside, inductor takes a
    static row count of at least `min_rows` as symbolic for that choice (None: its own choice stands), so those
    weights are packed for oneDNN as `dspark.packed` does eagerly on such CPUs. Not bit-identical to MKL's
    result; every compiled forward already differs from the eager one in the last bits."""
    try:
        from torch._inductor.fx_passes import mkldnn_fusion
        original = mkldnn_fusion.has_free_symbols
    except (ImportError, AttributeError):  # another torch: its own choice stands
        min_rows = None
    if min_rows is None:
        yield
        return

    def symbolic(size) -> bool:
        return original(size) or (isinstance(size, int) and size >= min_rows)

    mkldnn_fusion.has_free_symbols = symbolic
    try:
        with inductor_config.patch(post_grad_custom_post_pass=_CacheTag(f"dspark-onednn-float32-rows{min_rows}")):
            yield
    finally:
        mkldnn_fusion.has_free_symbols = original


def prefers_onednn_float32() -> bool:
    """Where float32 weights are packed for oneDNN eagerly (no native bf16: `auto` runs float32 there)."""
    return packed_by_default(torch.float32, torch.device("cpu"))


class CompiledDecode(nn.Module):
    """Embedding, the decoder layers and the LM head of one request's forward, with every dense weight a
    (frozen) parameter. Built from a backend's fused layers; shares the model's weight storage."""

    def __init__(self, backend, layer_ids: Sequence[int]) -> None:
        super().__init__()
        inner = backend.model.model
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        head = backend.model.get_output_embeddings()
        self.head_weight = _frozen(head.weight)
        self.num_heads, self.num_kv_heads, self.head_dim = backend.num_heads, backend.num_kv_heads, backend.head_dim
        self.gqa = bool(self.num_heads != self.num_kv_heads)  # a Python bool: dynamo specialises on it
        self.attention_dtype = backend.attention_dtype
        self.layer_ids = tuple(layer_ids)
        self.last_layer = backend.num_layers - 1
        self.layers = nn.ModuleList()
        for fused in backend.layers:
            layer = nn.Module()
            layer.qkv, layer.o_proj = _frozen(_dense(fused.qkv)), _frozen(_dense(fused.o_proj))
            layer.gate_up, layer.down = _frozen(_dense(fused.gate_up)), _frozen(_dense(fused.down))
            layer.qkv_bias = None if fused.qkv_bias is None else _frozen(fused.qkv_bias)
            layer.input_norm, layer.post_norm = fused.input_norm, fused.post_norm
            self.layers.append(layer)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slot_index: torch.Tensor,
                layouts: tuple[BatchLayout, ...], logit_rows: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (len(logit_rows), V) of the new tokens at `logit_rows` (flat indices: a prompt chunk needs one
        or none, so its LM head is not paid per token) and hidden states of `layer_ids` (N, D·len) or None of every
        new token of a round; writes each token's keys and values at its (slot_index, position); attention runs
        over the padded blocks of `layouts` (`dspark.ragged.round_layouts`)."""
        n = tokens.shape[0]
        heads, kv_heads, hd = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed(tokens)
        cos, sin = self.rotary(x, positions[None])
        cos, sin = cos[0][:, None], half_signed(sin[0][:, None])
        features = {-1: x} if -1 in self.layer_ids else {}
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            v = qkv[:, (heads + kv_heads) * hd :].view(n, kv_heads, hd)
            qk = rotate(qkv[:, : (heads + kv_heads) * hd].view(n, heads + kv_heads, hd), cos, sin)
            q, k, v = (t.to(self.attention_dtype) for t in (qk[:, :heads], qk[:, heads:], v))
            # tensor indices for the write: a slice `[slot]` or `slot : slot + 1` made inductor's in-place pass
            # guard `slot == 0`, a graph pair for slot 0 beside the pair every other slot shared
            keys[index][slot_index, :, positions] = k
            values[index][slot_index, :, positions] = v
            out = round_attention(q, keys[index], values[index], layouts, self.gqa)
            x = x + F.linear(out.reshape(n, -1).to(x.dtype), layer.o_proj)
            h = rms_norm(x, layer.post_norm)
            gate, up = F.linear(h, layer.gate_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
            if index in self.layer_ids:
                features[index] = x
        hidden = None
        if self.layer_ids:
            if self.last_layer in features:  # HF reports the last layer's output after the final norm
                features[self.last_layer] = rms_norm(features[self.last_layer], self.norm)
            hidden = torch.cat([features[i] for i in self.layer_ids], -1)
        return F.linear(rms_norm(x[logit_rows], self.norm), self.head_weight).float(), hidden


def compilable(backend) -> bool:
    """Whether `CompiledDecode` computes this backend's forward: dense (not int4) Llama-style layers without
    q/k norms (Qwen3's run eager), no sliding window."""
    return (not backend.window and all(fused.q_norm is None for fused in backend.layers)
            and all(isinstance(_dense(w), torch.Tensor) for fused in backend.layers
                    for w in (fused.qkv, fused.o_proj, fused.gate_up, fused.down))
            and isinstance(getattr(backend.model.get_output_embeddings(), "weight", None), torch.Tensor))


def compiled_decode(backend) -> "CompiledRunner | None":
    """The compiled forward for `backend`'s model and layer ids, made once per (model, layer ids): every
    backend on the model (one engine per prompt in a benchmark) shares one compilation. None, said once per
    model, where `compilable` says no."""
    cache = backend.model.__dict__.setdefault("_dspark_compiled", {})
    key = (backend.layer_ids, backend.attention_dtype)
    if key not in cache:
        cache[key] = CompiledRunner(CompiledDecode(backend, backend.layer_ids).eval()) if compilable(backend) else None
        if cache[key] is None:
            log(f"--compile: {backend.config.model_type} layers of this form run eager (q/k norms, int4 or a window)")
    return cache[key]


class CompiledRunner:
    """Calls the compiled module (the target's `CompiledDecode`, a drafter's block); if compiling or running it fails
    once (no C++ compiler, an inductor bug), says why on stderr and answers None from then on, so the caller runs
    its eager forward instead. `what` names the forward in that message."""

    #: the most new tokens a call of the target's forward takes per request (more: the backend's eager forward)
    max_tokens = MAX_COMPILED_TOKENS

    def __init__(self, module: nn.Module, what: str = "compiled forward") -> None:
        self.module = module
        self.what = what
        self.compiled = torch.compile(module, dynamic=True)
        self.failed: str | None = None
        self.onednn_rows = ONEDNN_MIN_ROWS if prefers_onednn_float32() else None  # `onednn_float32`

    def __call__(self, tokens: torch.Tensor, *args) -> tuple | None:
        """The module's forward on (tokens, *args), or None once compiling or running it has failed."""
        if self.failed is not None:
            return None
        # a copy made here is an inference tensor whoever made `tokens` (a warm-up inside inference mode, an engine
        # outside it): dynamo guards on a tensor's dispatch keys, and the other kind would compile every graph again
        with torch.inference_mode():
            tokens = tokens.clone()
        try:  # the settings as a patch around the call: `torch.compile(options=...)` does not apply `freezing`
            # no duck sizing: sizes that happen to be equal when a graph is traced (8 slots, 8 tokens) would become
            # one symbol, and the graph would be traced again the first time they differ
            with (inductor_config.patch(INDUCTOR_OPTIONS), shape_config.patch(use_duck_shape=False),
                  onednn_float32(self.onednn_rows)):
                return self.compiled(tokens, *args)
        except Exception as error:  # noqa: BLE001 - any compile failure falls back to the eager forward
            self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            log(f"{self.what} unavailable ({self.failed}); running eager")
            return None


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach(), requires_grad=False)


def _dense(weight):
    """The dense tensor behind a fused weight: a tensor, a `PackedLinear`'s parameter, or (int4) the module."""
    return weight if isinstance(weight, torch.Tensor) else getattr(weight, "weight", weight)


