"""Session 17: the mean of two drafters' weights (a "model soup" of run 11, the shipped drafter, and run 12, which
continued from it), written as an uncalibrated run directory for training/post_run.sh.

    python training/session17/soup.py A_DIR B_DIR OUT_RUN_DIR TRAIN_RUN_DIR

Floating tensors are averaged in float32 and stored in their own dtype; every other tensor (the draft vocabulary's
d2t map) must be equal. The config is B's uncalibrated one (post_run.sh calibrates the soup itself).
"""

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

a_dir, b_dir, out_run, train_run = (Path(p) for p in sys.argv[1:5])
a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
assert a.keys() == b.keys(), "the drafters hold different tensors"
soup = {}
for name, tensor in a.items():
    if tensor.is_floating_point():
        soup[name] = ((tensor.float() + b[name].float()) / 2).to(tensor.dtype)
    else:
        assert torch.equal(tensor, b[name]), f"{name} differs"
        soup[name] = tensor
(out_run / "final").mkdir(parents=True, exist_ok=True)
save_file(soup, out_run / "final" / "model.safetensors", metadata={"format": "pt"})
shutil.copy(b_dir / "config.json", out_run / "final" / "config.json")
for name in ("train_log.jsonl", "train_config.json"):
    shutil.copy(train_run / name, out_run / name)
print(f"soup of {a_dir} and {b_dir}: {len(soup)} tensors -> {out_run / 'final'}")
