"""A training checkpoint's drafter as the trainer's `final` would be (float16), for a run stopped before its last
step (session 7 stopped run 3 at 1,300 of 1,600; session 32 run 23 at 1,000 of 1,200):

    python training/export_fp16.py runs/run23/checkpoint-0001000 runs/run23/final

Floating tensors are cast to float16 (the trainer's `save_dtype`), integer and boolean ones (the draft vocabulary's
d2t / t2d maps) kept, and the config's dtype fields follow; the optimiser state is not copied."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main(source: str, destination: str) -> None:
    source_dir, out = Path(source), Path(destination)
    out.mkdir(parents=True, exist_ok=False)
    tensors = {name: t.to(torch.float16) if t.is_floating_point() else t
               for name, t in load_file(str(source_dir / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source_dir / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:3])
