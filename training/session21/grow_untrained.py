"""Session 21: the shipped drafter (run 16) saved again as built for training with 2 and with 3 draft layers (the third
grown by `grown_layers`, i.e. adding nothing): the same tau, so `dspark eval` on both measures what the third layer
costs per round, and checks end to end that a grown drafter drafts exactly what the trained one does.
    python training/session21/grow_untrained.py OUT_DIR"""
import sys
from pathlib import Path

import torch

from dspark.loading import load_target
from dspark.train.config import load_config
from dspark.train.drafter_specs import DRAFTERS

out = Path(sys.argv[1])
target = load_target("default", dtype=torch.float32).model
for layers in (2, 3):
    config = load_config("configs/smollm2-dspark-cached.yaml", [
        "init_from=dspark/checkpoints/smollm2-135m-dspark", f"num_draft_layers={layers}"])
    drafter = DRAFTERS["dspark"].build(config, target)
    DRAFTERS["dspark"].save(drafter, out / f"layers{layers}", torch.float16)
    print(layers, "layers saved")
