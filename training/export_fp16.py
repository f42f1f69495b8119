"""A training checkpoint's drafter as the trainer's `final` would be (float16), for a run stopped before its last
step (session 7 stopped run 3 at 1,300 of 1,600; session 32 run 23 at 1,000 of 1,200):

    python training/export_fp16.py runs/run23/checkpoint-0001000 runs/run23/final

The drafter's own loader and writer (`load_model`, `save_pretrained`): floating tensors in float16, the draft
vocabulary's maps kept, the config's dtype following; the optimiser state is not copied."""

import sys
from pathlib import Path

import torch

from dspark.drafters.checkpoint import load_model, save_pretrained


def main(source: str, destination: str) -> None:
    out = Path(destination)
    out.mkdir(parents=True, exist_ok=False)
    save_pretrained(load_model(source), out, dtype=torch.float16)


if __name__ == "__main__":
    main(*sys.argv[1:3])
