"""The on-disk shape every drafter checkpoint shares: a directory with config.json + model.safetensors."""

import json
from pathlib import Path

from dspark.errors import DrafterLoadError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


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
