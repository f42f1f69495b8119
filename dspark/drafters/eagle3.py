"""EAGLE-3 baseline drafter (Li et al. 2025): one autoregressive decoder layer on fused target features.

Step 1 of a draft pairs fc([low; mid; high] target features of position t) with the embedding of token
t+1 and predicts token t+2 (EAGLE/MTP alignment). The layer's attention reads the concatenation
[input_layernorm(embed); hidden_norm(hidden)] (2·D wide) and its residual stream is the hidden input.
Steps j > 1 feed the layer's own output hidden state back in place of the target feature, paired with
the previous draft token ("training-time test", TTT, unrolled the same way in `forward`).

So the anchor (last committed token, whose own feature the target has not computed yet) pairs with the
feature of the position before it. Per request we keep the layer's K/V of every committed pair
(feature_s, token_{s+1}); each round appends the pairs completed since the last one, and draft steps
append temporary K/V that are dropped afterwards. RoPE position of step j at position t is t + j - 1
both here and in training (EAGLE-3's own trainer keeps t for every step, but drafts at increasing
positions), so the training forward and the inference path compute the same function.

The small Llama building blocks (norm, RoPE, attention, K/V cache, checkpoint I/O) are shared with
the MTP drafter (`dspark.drafters.mtp`).
"""

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.drafters.base import Draft, Drafter
from dspark.drafters.files import CONFIG_FILE, WEIGHTS_FILE, read_config_json
from dspark.drafters.layers import MLP, RMSNorm, apply_rope, rope_cos_sin, target_layer_shape
from dspark.errors import DrafterLoadError
from dspark.sampling import SamplingParams, probabilities, sample
from dspark.target import Target

#: attend(q, k, v) -> attention output; q (B, H, T, hd), k/v (B, H_kv, T, hd) of the new positions.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]



# -- configuration -----------------------------------------------------------------------------


@dataclass
class DraftLayerConfig:
    """Shape of a Llama-style draft layer at the target's hidden size."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    #: DeepSpec convention: id L = output of target layer L (0-based), -1 = embeddings; () = default.
    target_layer_ids: tuple[int, ...] = ()
    #: block size γ: TTT steps / MTP depths the drafter is trained for (and drafts at most, for MTP).
    num_speculative_tokens: int = 7

    def __post_init__(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features read: len(target_layer_ids) * D."""
        return len(self.target_layer_ids) * self.hidden_size

    @staticmethod
    def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
        raise NotImplementedError

    @classmethod
    def for_target(cls, target: Any, **overrides: Any) -> "DraftLayerConfig":
        """A config with the target's layer shape; any field can be overridden."""
        _, lm_head, text = target_parts(target)
        values = dict(
            **target_layer_shape(text),
            vocab_size=int(lm_head.weight.shape[0]),
            target_layer_ids=cls.default_layer_ids(int(text.num_hidden_layers)),
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict:
        values = asdict(self)
        values["target_layer_ids"] = list(self.target_layer_ids)
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "DraftLayerConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in known})


@dataclass
class Eagle3Config(DraftLayerConfig):
    @staticmethod
    def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
        """Low / mid / high = (1, L//2 - 1, L - 4), as EAGLE-3 / SpecForge pick them."""
        last = num_target_layers - 1
        return tuple(min(max(i, -1), last) for i in (1, num_target_layers // 2 - 1, num_target_layers - 4))


# -- Llama building blocks ---------------------------------------------------------------------


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x (B, H, T, hd) at absolute positions (T,)."""
    cos, sin = rope_cos_sin(positions.to(x.device)[None], x.shape[-1], theta, x.dtype)
    return apply_rope(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, config: DraftLayerConfig, input_size: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = rope(q, positions, self.rope_theta)
        k = rope(k, positions, self.rope_theta)
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer; `block` takes the (already normalised) attention input separately from
    the residual stream, which is what lets EAGLE-3 widen its attention input to 2·D."""

    def __init__(self, config: DraftLayerConfig, attention_input_size: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, attention_input_size or config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def block(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = residual + self.self_attn(x, positions, attend)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        return self.block(self.input_layernorm(h), h, positions, attend)


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal self-attention over one whole sequence (training forwards)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class KVCache:
    """One request's K/V (1, H_kv, T, hd) of one layer. Grown by doubling; rollback (`crop`) only moves
    `length` back, so dropping a round's draft steps costs nothing."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append the new positions' K/V, then attend: new position i sees cache entries 0..start+i."""
        start, end = self.length, self.length + k.shape[2]
        if self.k is None or end > self.k.shape[2]:
            self.k, self.v = _grown(self.k, k, end, start), _grown(self.v, v, end, start)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        keys, values = self.keys_values()
        query_end = start + 1 + torch.arange(q.shape[2], device=q.device)
        mask = torch.arange(end, device=q.device) < query_end[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _grown(old: torch.Tensor | None, like: torch.Tensor, needed: int, length: int) -> torch.Tensor:
    capacity = max(needed, 2 * (0 if old is None else old.shape[2]), 64)
    new = like.new_empty(like.shape[0], like.shape[1], capacity, like.shape[3])
    if old is not None and length:
        new[:, :, :length] = old[:, :, :length]
    return new


class TTTAttend:
    """Training-time-test attention over a whole sequence, unrolled step by step.

    At step j, position t sees the step-1 K/V of positions <= t (the committed context, as cached at
    inference) plus its own K/V from steps 2..j (its draft chain): causal block + diagonals.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        groups = q.shape[1] // k.shape[1]
        keys = [x.repeat_interleave(groups, 1) for x in self.keys]
        values = [x.repeat_interleave(groups, 1) for x in self.values]
        length, scale = q.shape[2], q.shape[-1] ** -0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        context = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
        chain = [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]
        probs = torch.cat([context, *chain], -1).float().softmax(-1).to(q.dtype)
        out = probs[..., :length] @ values[0]
        for i, value in enumerate(values[1:]):
            out = out + probs[..., length + i : length + i + 1] * value
        return out


def shift_left(input_ids: torch.Tensor, n: int) -> torch.Tensor:
    """input_ids (B, T) moved n places left, padded with 0 (those positions are invalid)."""
    return F.pad(input_ids[:, n:], (0, min(n, input_ids.shape[1])))


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """HF-style init of our own parameters: normal(0, std) linears, unit norms."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, std=std)
        elif isinstance(sub, RMSNorm):
            nn.init.ones_(sub.weight)


# -- the target's frozen embedding and LM head; checkpoints ------------------------------------


def target_parts(target: Any) -> tuple[nn.Module, nn.Module, Any]:
    """(embedding, LM head, text config) of a `Target` or an HF causal LM."""
    model = target.model if isinstance(target, Target) else target
    return model.get_input_embeddings(), model.get_output_embeddings(), model.config.get_text_config()


class SharedHeadsMixin:
    """Uses the target's embedding and LM head without owning them: they are kept in a plain tuple,
    so they are neither registered, saved, trained nor moved with the drafter."""

    _shared: tuple[nn.Module, nn.Module]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._shared[0](input_ids).to(self.dtype)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self._shared[1]
        return head(hidden.to(head.weight.dtype))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


def save_checkpoint(model: nn.Module, directory: str | Path, architecture: str, drafter_type: str,
                    extra: dict | None = None) -> None:
    """config.json (DeepSpec/vLLM style + a `dspark` field) and model.safetensors (own weights only)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture], **model.config.to_dict(), **(extra or {})}
    config["dspark"] = {"drafter_type": drafter_type}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def read_checkpoint(directory: str | Path, drafter_type: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, weights) of a checkpoint directory; DrafterLoadError on anything unreadable."""
    directory = Path(directory)
    config = read_config_json(directory)
    declared = (config.get("dspark") or {}).get("drafter_type", drafter_type)
    if declared != drafter_type:
        raise DrafterLoadError(f"{directory} holds a {declared!r} drafter, not {drafter_type!r}")
    try:
        weights = load_file(str(directory / WEIGHTS_FILE))
    except FileNotFoundError as error:
        raise DrafterLoadError(f"drafter directory {directory} has no {WEIGHTS_FILE}") from error
    except (SafetensorError, OSError, ValueError) as error:
        raise DrafterLoadError(f"drafter weights {directory / WEIGHTS_FILE} are unreadable: {error}") from error
    return config, weights


def build_for_target(model_cls: type, config: DraftLayerConfig, target: Any,
                     weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """The drafter on the target's device and dtype, checked against the target's shape."""
    embed, lm_head, text = target_parts(target)
    hidden, vocab, num_layers = int(text.hidden_size), int(lm_head.weight.shape[0]), int(text.num_hidden_layers)
    if config.hidden_size != hidden or embed.weight.shape[1] != hidden:
        raise DrafterLoadError(f"drafter hidden size {config.hidden_size} does not match the target's {hidden}")
    if config.vocab_size != vocab:
        raise DrafterLoadError(f"drafter vocabulary of {config.vocab_size} does not match the target's {vocab}")
    bad = [i for i in config.target_layer_ids if not -1 <= i < num_layers]
    if bad or not config.target_layer_ids:
        raise DrafterLoadError(f"target layer ids {config.target_layer_ids} do not fit a {num_layers}-layer target")
    model = model_cls(config, embed, lm_head).to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
    if weights is not None:
        try:
            model.load_state_dict(weights, strict=True)
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0][:300]
            raise DrafterLoadError(f"drafter weights do not fit its config: {first}") from error
    return model


def parse_config(config_cls: type, values: dict) -> DraftLayerConfig:
    try:
        return config_cls.from_dict(values)
    except (TypeError, ValueError) as error:
        raise DrafterLoadError(f"invalid drafter config: {error}") from error


def pick_token(probs: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Draw from exactly `probs` (the q handed to verification); the argmax when greedy (one-hot)."""
    return probs.argmax(-1) if sampling.greedy else sample(probs, generator)


# -- EAGLE-3 -----------------------------------------------------------------------------------


class Eagle3Layer(DecoderLayer):
    """The EAGLE-3 midlayer: attention reads [input_layernorm(embed); hidden_norm(hidden)]."""

    def __init__(self, config: DraftLayerConfig) -> None:
        super().__init__(config, 2 * config.hidden_size)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        return self.block(x, hidden, positions, attend)


class Eagle3Model(SharedHeadsMixin, nn.Module):
    """fc (F -> D), one midlayer, own final norm; the target's embedding and LM head.
    Parameter names follow the EAGLE-3 checkpoints (fc, midlayer.*, norm)."""

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._shared = (embed_tokens, lm_head)
        init_weights(self)

    @classmethod
    def for_target(cls, target: Any, **overrides: Any) -> "Eagle3Model":
        """A freshly initialised drafter shaped like the target (any config field can be overridden)."""
        return build_for_target(cls, Eagle3Config.for_target(target, **overrides), target)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """fc([low; mid; high]) of target features (..., F)."""
        return self.fc(features.to(self.dtype))

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             attend: Attend) -> torch.Tensor:
        """One draft step: tokens (B, T) with their paired hidden (B, T, D) -> output hidden (B, T, D)."""
        return self.midlayer(self.embed(input_ids), hidden, positions, attend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(
        self, features: torch.Tensor, input_ids: torch.Tensor, num_steps: int | None = None
    ) -> list[torch.Tensor]:
        """Training-time test over whole sequences: features (B, T, F) and input_ids (B, T) of the same
        positions. Returns one (B, T, V) logits per step; logits[j][:, t] predicts input_ids[:, t+j+2]
        (valid while t + j + 2 < T). Step j > 0 feeds back step j-1's hidden and token t+j+1."""
        num_steps = num_steps or self.config.num_speculative_tokens
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden, attend, logits = self.fuse(features), TTTAttend(), []
        for j in range(num_steps):
            hidden = self.step(shift_left(input_ids, j + 1), hidden, positions + j, attend)
            logits.append(self.logits(hidden))
        return logits

    def save_pretrained(self, directory: str | Path) -> None:
        aux_ids = [i + 1 for i in self.config.target_layer_ids]  # vLLM counts inputs of layers, not outputs
        extra = {"model_type": "llama", "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids}}
        save_checkpoint(self, directory, "Eagle3LlamaForCausalLM", "eagle3", extra)

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: Any) -> "Eagle3Model":
        """Load a checkpoint for `target` (a `Target` or HF causal LM); DrafterLoadError if it does not fit."""
        values, weights = read_checkpoint(directory, "eagle3")
        return build_for_target(cls, parse_config(Eagle3Config, values), target, weights)


@dataclass
class Eagle3State:
    """Per request: the layer's K/V of every committed pair (feature_s, token_{s+1}); the target features
    of later positions, waiting for their next token; the output hidden at the newest cached pair."""

    cache: KVCache
    features: torch.Tensor
    hidden: torch.Tensor | None = None


class Eagle3Drafter(Drafter):
    def __init__(self, model: Eagle3Model) -> None:
        self.model = model.eval()
        self.config = model.config
        self.target_layer_ids = model.config.target_layer_ids
        self.vocab_size = model.config.vocab_size
        self.max_block_size = None  # autoregressive: any length, though trained for num_speculative_tokens

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: Any) -> "Eagle3Drafter":
        return cls(Eagle3Model.from_pretrained(directory, target))

    def save_pretrained(self, directory: str | Path) -> None:
        self.model.save_pretrained(directory)

    @torch.inference_mode()
    def start(self, prompt_ids: torch.Tensor, prompt_hidden: torch.Tensor | None) -> Eagle3State:
        state = Eagle3State(KVCache(), self._checked(prompt_hidden)[:0])
        self.commit(state, prompt_hidden)
        return state

    @torch.inference_mode()
    def commit(self, state: Eagle3State, committed_hidden: torch.Tensor | None) -> None:
        state.features = torch.cat([state.features, self._checked(committed_hidden)])

    def _checked(self, features: torch.Tensor | None) -> torch.Tensor:
        return checked_features(features, self.config, self.model.device)

    @torch.inference_mode()
    def propose(self, state: Eagle3State, context: torch.Tensor, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if num_tokens <= 0:
            return Draft.empty(self.model.device)
        hidden = self._absorb(state, context)
        committed, position = state.cache.length, context.shape[0] - 2
        tokens, q = [], []
        for j in range(num_tokens):
            if j:
                step_position = torch.tensor([position + j], device=hidden.device)
                hidden = self.model.step(tokens[-1].view(1, 1), hidden, step_position, state.cache.attend)
            probs = probabilities(self.model.logits(hidden)[0, -1], sampling)
            tokens.append(pick_token(probs, sampling, generator))
            q.append(probs)
        state.cache.crop(committed)  # drop the draft steps' K/V
        return Draft(torch.stack(tokens), torch.stack(q))

    def _absorb(self, state: Eagle3State, context: torch.Tensor) -> torch.Tensor:
        """Cache the pairs completed since the last round: the waiting features with their now-known
        next tokens (the last pair holds the anchor). Returns the output hidden (1, 1, D) of that pair."""
        start = state.cache.length
        end = start + state.features.shape[0]
        if end != context.shape[0] - 1:
            raise RuntimeError(
                f"the drafter has features of {end} positions but the context before the anchor has "
                f"{context.shape[0] - 1}: commit the features of every position that entered the target cache"
            )
        if end > start:
            tokens = context[start + 1 : end + 1].to(self.model.device)[None]
            positions = torch.arange(start, end, device=tokens.device)
            out = self.model.step(tokens, self.model.fuse(state.features[None]), positions, state.cache.attend)
            state.hidden, state.features = out[:, -1:], state.features[:0]
        return state.hidden


def checked_features(features: torch.Tensor | None, config: DraftLayerConfig, device: torch.device) -> torch.Tensor:
    """Target features (n, F) moved to the drafter, or a clear error if the target does not tap them."""
    if features is None:
        raise ValueError(
            f"this drafter needs target features: build the Target with layer_ids={config.target_layer_ids}"
        )
    if features.dim() != 2 or features.shape[-1] != config.feature_size:
        raise ValueError(
            f"target features have shape {tuple(features.shape)}, the drafter reads (n, {config.feature_size}) "
            f"(layers {config.target_layer_ids})"
        )
    return features.to(device)
