"""Checkpoints that resume exactly: drafter weights, optimiser, LR schedule and every global RNG.

A checkpoint is written into a staging directory and renamed into place, so a run killed mid-write
leaves the previous checkpoint intact and `--resume latest` never sees a half-written one.
"""

import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from dspark.errors import DsparkError
from dspark.train.config import TrainConfig
from dspark.train.drafter_specs import DrafterSpec

STATE_FILE = "trainer_state.pt"
CHECKPOINT_PREFIX = "checkpoint-"



def rng_state() -> dict:
    """Every global RNG, as tensors / lists / ints only (loadable with torch.load(weights_only=True))."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(mt), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints (they are renamed into place only once fully written), oldest first."""
    found = [p for p in output_dir.glob(f"{CHECKPOINT_PREFIX}*") if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name)
             and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(directory) into a hidden staging directory, then rename it to `path`: a reader (or a resume
    after a kill) sees the old directory or the complete new one, never a half-written one."""
    staging = path.parent / f".tmp-{path.name}"
    shutil.rmtree(staging, ignore_errors=True)
    write(staging)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(staging, path)


def save_checkpoint(output_dir: Path, step: int, drafter: nn.Module, spec: DrafterSpec,
                    optimizer: torch.optim.Optimizer, scheduler, config: TrainConfig, keep: int) -> Path:
    """checkpoint-<step>/: drafter weights (float32, so that resuming is exact) + trainer_state.pt."""
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "config": config.to_dict(),
    }

    def write(directory: Path) -> None:
        spec.save(drafter, directory, torch.float32)
        torch.save(state, directory / STATE_FILE)

    final = output_dir / f"{CHECKPOINT_PREFIX}{step:07d}"
    write_atomically(final, write)
    if keep > 0:
        for old in checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_resume(resume: str | Path, output_dir: Path) -> Path:
    """'latest' (or True) -> the newest complete checkpoint of output_dir; else a checkpoint directory."""
    if str(resume) in ("latest", "True"):
        found = checkpoints(output_dir)
        if not found:
            raise DsparkError(f"--resume: no checkpoint in {output_dir}")
        return found[-1]
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise DsparkError(f"--resume: {path} is not a checkpoint (no {STATE_FILE})")
    return path


def restore_checkpoint(checkpoint: Path, config: TrainConfig, drafter: nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler, device: torch.device) -> int:
    """Load a checkpoint into the drafter, optimiser, LR schedule and global RNGs; returns its step."""
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
    _check_resume_config(state["config"], config, checkpoint)
    drafter.load_state_dict(load_file(str(checkpoint / "model.safetensors"), device=str(device)))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return int(state["step"])


#: fields that may differ between a run and its resumption
_RESUMABLE_CHANGES = {"output_dir", "save_every", "eval_every", "log_every", "keep_checkpoints", "threads",
                      "progress", "tensorboard", "save_dtype", "max_eval_sequences", "device"}


def _check_resume_config(saved: dict, config: TrainConfig, checkpoint: Path) -> None:
    """Warn (not refuse) when a setting that shapes the run changed: resuming still works, exactly no more."""
    current = config.to_dict()
    changed = sorted(k for k in current if k not in _RESUMABLE_CHANGES and saved.get(k) != current[k])
    if changed:
        print(f"[dspark] warning: resuming {checkpoint} with changed {', '.join(changed)}: the run will not "
              "match an uninterrupted one", file=sys.stderr)
