"""Session 20: write a drafter whose draft vocabulary is chosen again on the corpus (refresh_draft_vocab), untrained,
so that `dspark train --score` can compare it with the drafter it came from on the same text.
    python training/session20/refresh_vocab.py INIT OUT SIZE"""
import sys

import torch

from dspark.train.config import load_config
from dspark.train.drafter_specs import _dspark_save
from dspark.train.trainer import _prepare, setup

init, out, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = load_config("configs/smollm2-dspark-cached.yaml", [
    f"init_from={init}", "refresh_draft_vocab=true", f"draft_vocab_size={size}", "feature_cache=null",
    "online_features=true", "seq_len=1024", "threads=2", "progress=false", f"output_dir={out}"])
d = _prepare(config)
drafter = setup(config, d).drafter
d.close()
_dspark_save(drafter, out, torch.float16)
print(f"wrote {out}")
