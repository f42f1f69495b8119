"""Session 33: the shipped drafter on its own held-out corpus answers, per source, cut to the evaluation's length.

Writes a scratch corpus of the first 40 held-out samples of each source (the trainer's split: seq_len 1024,
heldout_fraction 0.02, split_seed 0), answers cut to their first 96 tokens as `dspark eval` generates, for
`dspark train --score` (teacher-forced; its rollout-order τ is what a greedy rollout along that text measures).
The split is by id, so on corpus v9 the v8 sources pick the same samples as session 33's (which read v8) and the
writing source adds its own 40.

    python training/session33/heldout_by_source.py /tmp/heldsrc/held96.safetensors [CORPUS]
    dspark train --config configs/smollm2-dspark-cached.yaml --score init_from=dspark/checkpoints/smollm2-135m-dspark \
        data=/tmp/heldsrc/held96.safetensors feature_cache=null online_features=true seq_len=1024 threads=1 \
        progress=false > training/session33/heldout96_score_run23.json
"""

import sys
from dataclasses import replace

import numpy as np

from dspark.train.cached_data import heldout_samples
from dspark.train.corpus import load_corpus, save_corpus

corpus = load_corpus(sys.argv[2] if len(sys.argv) > 2 else "corpora/smollm2-135m-instruct.safetensors")
by_source: dict[int, list[int]] = {}
for index in heldout_samples(corpus, 1024, 0.02, 0):  # the trainer's split: seq_len, heldout_fraction, split_seed
    by_source.setdefault(int(corpus.source_index[index]), []).append(index)
picked = [index for source in sorted(by_source) for index in by_source[source][:40]]
part = corpus.select(picked)
pieces = [np.concatenate([part.prompt_ids(i), part.answer_ids(i)[:96]]) for i in range(part.num_samples)]
offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
save_corpus(sys.argv[1], replace(part, tokens=np.concatenate(pieces).astype(part.tokens.dtype), offsets=offsets,
                                  finished=np.zeros_like(part.finished)))
