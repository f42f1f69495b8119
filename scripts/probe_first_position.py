"""Diagnostic: how much of draft position 1 can a small EAGLE-style MLP read from the cached features?

Trains an MLP from [RMSNorm(h_layer(a-1)); embed(x_a)] to the target's argmax at a (the token after the
anchor) on a feature cache, and reports held-out argmax agreement. `--split sample` holds out whole
answers, as `dspark train` does; `--split position` holds out random positions, which leak neighbouring
positions of the same answer into training (docs/training.md, session 5). `--no-feature` is the bigram
baseline. One thread, a few minutes; not part of the product.

    python scripts/probe_first_position.py --cache ~/.cache/dspark/features/smollm2 \\
        --corpus corpora/smollm2-135m-instruct.safetensors --layer 29 --split sample --seconds 200
"""

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dspark.train.corpus import load_corpus
from dspark.train.feature_cache import FeatureCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True)
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--weights", default="~/.cache/dspark/models/SmolLM2-135M-Instruct/model.safetensors",
                        help="the target's safetensors (for its tied embedding / LM head)")
    parser.add_argument("--layer", type=int, default=29)
    parser.add_argument("--split", choices=["sample", "position"], default="sample")
    parser.add_argument("--no-feature", action="store_true")
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--vocab", type=int, default=8192, help="draft vocabulary: the most frequent labels")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    cache = FeatureCache.open(args.cache, verify=False)
    corpus = load_corpus(args.corpus)
    weights = load_file(str(Path(args.weights).expanduser()))
    embed = next(v for k, v in weights.items() if "embed_tokens" in k).float()
    column, width = cache.layers.index(args.layer), cache.hidden_size
    features, tokens, labels, samples = [], [], [], []
    for i in range(cache.num_samples):
        sample = cache.sample(i)
        n, start, prompt = sample.hidden.shape[0], int(corpus.offsets[i]), int(corpus.prompt_lengths[i])
        ids = torch.from_numpy(corpus.tokens[start : start + n].astype(np.int64))
        anchors = torch.arange(max(prompt, 1), n - 1)
        features.append(sample.hidden.view(n, len(cache.layers), width)[anchors - 1, column])
        tokens.append(ids[anchors])
        labels.append(sample.topk_ids[anchors, 0])
        samples.append(torch.full((len(anchors),), i))
    x, e, y, s = torch.cat(features).float(), torch.cat(tokens), torch.cat(labels), torch.cat(samples)
    if args.no_feature:
        x = torch.zeros_like(x)
    if args.split == "sample":
        held = s >= cache.num_samples - 20
        test, train = held.nonzero()[:, 0], (~held).nonzero()[:, 0]
    else:
        order = torch.randperm(len(y))
        test, train = order[:5000], order[5000:]
    vocab = torch.bincount(y, minlength=embed.shape[0]).argsort(descending=True)[: args.vocab]
    to_draft = torch.full((embed.shape[0],), -1)
    to_draft[vocab] = torch.arange(len(vocab))
    head = embed[vocab]

    norm_in, norm_out = torch.nn.RMSNorm(width), torch.nn.RMSNorm(width)
    up, down = torch.nn.Linear(2 * width, 1536), torch.nn.Linear(1536, width)
    params = [*norm_in.parameters(), *norm_out.parameters(), *up.parameters(), *down.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)

    def logits(rows: torch.Tensor) -> torch.Tensor:
        z = torch.cat([norm_in(x[rows]), embed[e[rows]]], -1)
        return norm_out(down(F.silu(up(z)))) @ head.T

    def agreement() -> float:
        with torch.no_grad():
            return (vocab[logits(test).argmax(-1)] == y[test]).float().mean().item()

    unigram = (y[test] == vocab[0]).float().mean()
    print(f"{len(y)} positions, {len(test)} held out ({args.split}); unigram {unigram:.3f}")
    started, step = time.time(), 0
    while time.time() - started < args.seconds:
        rows = train[torch.randint(len(train), (512,))]
        target = to_draft[y[rows]]
        keep = target >= 0
        loss = F.cross_entropy(logits(rows)[keep], target[keep])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 200 == 0:
            print(f"step {step} train loss {loss.item():.3f} held-out agreement {agreement():.3f}", flush=True)
    print(f"final step {step} held-out agreement {agreement():.3f}")


if __name__ == "__main__":
    main()
