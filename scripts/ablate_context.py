"""Diagnostic: does a trained DSpark drafter read the state that produced the anchor?

Teacher-forced argmax agreement per block position on the last held-out-like corpus samples, with the
cached features as they are, zeroed, shifted one position later (the latest visible feature is then
h(a-2)) and shifted one earlier (h(a), which already predicts the token after the anchor, leaks in).
A drafter that uses the latest context position gains a lot from the leak and loses from the delay.
Not part of the product (docs/training.md, session 5).

    python scripts/ablate_context.py training/run1/drafter --cache ~/.cache/dspark/features/smollm2 \\
        --corpus corpora/smollm2-135m-instruct.safetensors
"""

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file

from dspark.drafters.checkpoint import load_model
from dspark.train.cached_data import cached_examples, make_cached_batch
from dspark.train.corpus import load_corpus
from dspark.train.feature_cache import FeatureCache
from dspark.train.losses import greedy_accepts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter")
    parser.add_argument("--cache", required=True)
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--weights", default="~/.cache/dspark/models/SmolLM2-135M-Instruct/model.safetensors")
    parser.add_argument("--samples", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)

    cache, corpus = FeatureCache.open(args.cache, verify=False), load_corpus(args.corpus)
    weights = load_file(str(Path(args.weights).expanduser()))
    embed = torch.nn.Embedding.from_pretrained(next(v for k, v in weights.items() if "embed_tokens" in k).float())
    head = torch.nn.Linear(embed.weight.shape[1], embed.weight.shape[0], bias=False)
    head.weight = embed.weight
    model = load_model(args.drafter, dtype=torch.float32)
    model.share_embeddings(embed, head)
    gamma = model.config.block_size
    examples = cached_examples(corpus, cache)[-args.samples :]
    batch = make_cached_batch(examples, cache, model.config.target_layer_ids, list(range(len(examples))), 1024,
                              gamma, 2, torch.device("cpu"))
    to_target = model.draft_to_target() if model.reduced_vocab else None
    lengths = batch.attention_mask.sum(1)[:, None, None]
    valid = batch.keep[..., None] & (batch.anchors[..., None] + torch.arange(gamma) + 1 < lengths)

    def agreement(features: torch.Tensor) -> list[float]:
        with torch.no_grad():
            logits = model.forward_train(features, batch.input_ids, batch.anchors).logits
        agree = greedy_accepts(logits, batch.teacher, to_target) & valid
        return [round(v, 3) for v in (agree.sum((0, 1)).float() / valid.sum((0, 1))).tolist()]

    features = batch.features
    later, earlier = features.clone(), features.clone()
    later[:, 1:] = features[:, :-1]
    earlier[:, :-1] = features[:, 1:]
    for name, variant in (("as cached", features), ("zeroed", torch.zeros_like(features)),
                          ("one later (h(a-2) last)", later), ("one earlier (h(a) leaks)", earlier)):
        print(f"{name:>26}: {agreement(variant)}")


if __name__ == "__main__":
    main()
