"""The on-disk shape every drafter checkpoint shares: a directory with config.json + model.safetensors
(or shards listed by model.safetensors.index.json). Every drafter reads its files through here, so the
shard-name checks and the error messages are the same for all of them."""

import json
from pathlib import Path, PurePosixPath

import torch
from safetensors import safe_open

from dspark.errors import DrafterLoadError, DsparkError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


def read_config_json(directory: str | Path) -> dict:
    """The checkpoint's config.json as a dict; DrafterLoadError if missing, not JSON or not an object."""
    config_file = Path(directory) / CONFIG_FILE
    try:
        data = json.loads(config_file.read_text())
    except FileNotFoundError as error:
        raise DrafterLoadError(f"drafter directory {directory} has no {CONFIG_FILE}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DrafterLoadError(f"drafter config {config_file} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise DrafterLoadError(f"drafter config {config_file} is not a JSON object")
    return data


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: model.safetensors, else the shards its index names (only
    safetensors: a pickle can run code). DrafterLoadError naming the file on anything unreadable."""
    directory = Path(directory)
    index_file = directory / WEIGHTS_INDEX_FILE
    if (directory / WEIGHTS_FILE).is_file():
        files = [directory / WEIGHTS_FILE]
    elif index_file.is_file():
        files = index_shard_files(index_file)  # refuses names that leave the checkpoint directory
    else:
        raise DrafterLoadError(f"no {WEIGHTS_FILE} in drafter directory {directory} (only safetensors are read)")
    weights = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as reader:
                for key in reader.keys():
                    weights[key] = reader.get_tensor(key)
        except Exception as error:  # safetensors raises several types for missing/truncated files
            raise DrafterLoadError(f"could not read drafter weights {file}: {error}") from error
    return weights


def index_shard_files(index_file: Path, error: type[DsparkError] = DrafterLoadError) -> list[Path]:
    """The shard files a safetensors index names. An index is data from whoever made the checkpoint:
    a name that leaves its directory ("../../x", "/etc/x") is refused, and every error names the file.
    (The check is on the names, so a directory of symlinks, as in the Hugging Face cache, still loads.)"""
    try:
        names = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, AttributeError, TypeError) as cause:
        raise error(f"{index_file} is not a valid safetensors index: {cause}") from cause
    for name in names:
        if not shard_name_stays_inside(name):
            raise error(f"{index_file} names shard {name!r}, which is outside the checkpoint directory")
    return [index_file.parent / name for name in names]


def shard_name_stays_inside(name: object) -> bool:
    """A relative path without ".." parts, backslashes (Windows' separator) or NUL bytes."""
    if not isinstance(name, str) or not name.strip(".") or "\\" in name or "\0" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts
