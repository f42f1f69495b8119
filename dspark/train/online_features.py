"""The feature cache's contents computed by the target per batch, for runs that should not build one.

A cache pays for itself once a run reads the corpus more than about once. On a 2-core CPU it costs as
much target time as a whole epoch (~80 min for the default corpus, 7 GB per million tokens) and it does
not survive a change of machine, while one session's run reads about a quarter of an epoch. Then it is
cheaper to run the target on each batch's samples only. `TargetFeatureSource` computes exactly what
`FeatureCache` holds for those samples (the same `target_outputs`: hidden states stored as bf16, top-k
teacher logits, logsumexp), so both pipelines train the same function with the same top-k loss and
reduced draft vocabulary; only where the numbers come from differs.
"""

from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from dspark.train.feature_cache import CachedSample, FeatureCacheError, sample_bounds, target_outputs


class TargetFeatureSource:
    """Reads like a `FeatureCache` (`num_samples`, `length`, `columns`, `samples`) but runs the frozen
    target on the requested samples, batched and right-padded."""

    def __init__(self, model: PreTrainedModel, corpus, top_k: int, max_len: int, pad_id: int) -> None:
        self.model = model.eval().requires_grad_(False)
        self.num_layers = int(model.config.get_text_config().num_hidden_layers)
        self.tokens = corpus.tokens
        self.offsets = corpus.offsets
        self.bounds = sample_bounds(corpus.offsets, max_len)
        self.top_k = top_k
        self.pad_id = pad_id

    @property
    def num_samples(self) -> int:
        return len(self.bounds) - 1

    def length(self, index: int) -> int:
        return int(self.bounds[index + 1] - self.bounds[index])

    def columns(self, layers: Sequence[int]) -> list[int]:
        """Every layer of the target can be computed; refuse ids it does not have (as the cache refuses
        layers it did not store)."""
        bad = [i for i in layers if not -1 <= i < self.num_layers]
        if bad or not layers:
            raise FeatureCacheError(f"target layer ids {list(layers)} do not fit a {self.num_layers}-layer target")
        return list(range(len(layers)))

    def samples(self, indices: Sequence[int], layers: Sequence[int]) -> list[CachedSample]:
        """One target forward over the samples `indices` (each cut to max_len)."""
        self.columns(layers)
        lengths = [self.length(i) for i in indices]
        ids = torch.full((len(indices), max(lengths)), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (i, n) in enumerate(zip(indices, lengths, strict=True)):
            start = int(self.offsets[i])
            ids[row, :n] = torch.from_numpy(self.tokens[start : start + n].astype(np.int64))
            mask[row, :n] = 1
        device = self.model.get_output_embeddings().weight.device
        hidden, top_ids, top_logits, lse = target_outputs(self.model, ids.to(device), mask.to(device), tuple(layers),
                                                          self.top_k)
        # clones made outside inference mode: the features enter the drafter's autograd graph
        return [CachedSample(hidden[row, :n].to(torch.bfloat16).cpu().clone(), top_ids[row, :n].cpu().clone(),
                             top_logits[row, :n].cpu().clone(), lse[row, :n].cpu().clone())
                for row, n in enumerate(lengths)]
