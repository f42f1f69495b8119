"""Incremental detokenisation with stop strings (shared by `stream` and the server): the text equals
decoding every token at once, also when characters split across tokens, at O(new tokens) a round."""

import random

import pytest
from conftest import tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dspark.text import IncrementalDetokenizer, TextAccumulator

MULTIBYTE = "he said 你好 🙂 héllo, wörld! naïve café, 日本語のテキスト 🙂🙂 the end."


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE trained on a few Latin words: CJK and emoji split into byte tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    backend.train_from_iterator(["hello world, héllo wörld", "naïve café résumé", "he said the end"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama style: '▁' for spaces, <0xXX> tokens for unknown characters, the leading space stripped."""
    vocab = {"<unk>": 0, "<eos>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for char in "▁abcdefghijklmnopqrstuvwxyzé!,.":
        vocab.setdefault(char, len(vocab))
    merges = [("▁", "h"), ("▁h", "e")]
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")


def chunked(tokens: list[int], seed: int, largest: int = 8) -> list[list[int]]:
    rng, chunks, at = random.Random(seed), [], 0
    while at < len(tokens):
        size = rng.randint(1, largest)
        chunks.append(tokens[at : at + size])
        at += size
    return chunks


def reference(tokenizer, tokens: list[int], stop: list[str]) -> tuple[str, list[int]]:
    """Decoding everything at once: the shortest prefix whose text holds a stop string, cut there."""
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return text[: min(hits)], tokens[:n]
    return tokenizer.decode(tokens, skip_special_tokens=True), tokens


def streamed(tokenizer, chunks: list[list[int]], stop: list[str] | None = None) -> tuple[list[str], TextAccumulator]:
    text = TextAccumulator(tokenizer, stop)
    deltas = []
    for chunk in chunks:
        deltas.append(text.add(chunk))
        if text.stopped:
            break
    deltas.append(text.flush())
    return deltas, text


def test_deltas_add_up_and_stop_strings_cut():
    tokenizer = tiny_tokenizer()
    tokens = ids(tokenizer, "w1 w2 w3 w14 w5 w6")
    plain = TextAccumulator(tokenizer)
    text = "".join(plain.add([t]) for t in tokens) + plain.flush()
    assert text == "w1 w2 w3 w14 w5 w6" and not plain.stopped

    stopping = TextAccumulator(tokenizer, stop=["w14 w5"])
    deltas = []
    for token in tokens:
        deltas.append(stopping.add([token]))
        if stopping.stopped:
            break
    deltas.append(stopping.flush())
    assert "".join(deltas) == "w1 w2 w3 " and stopping.stopped
    assert stopping.tokens == tokens[:5]  # through the token that completed the stop string
    # the held-back tail never leaked a prefix of the stop string
    assert all("w14" not in d for d in deltas)


@pytest.mark.parametrize("make", [byte_level_tokenizer, byte_fallback_tokenizer, tiny_tokenizer])
def test_incremental_text_equals_decoding_everything_at_once(make):
    tokenizer = make()
    text = MULTIBYTE if make is not tiny_tokenizer else "w1 w2 w3 w14 w5 w6 w7"
    tokens = ids(tokenizer, text) + [tokenizer.eos_token_id]
    assert tokenizer.decode([tokens[3]]) != text[3] or make is tiny_tokenizer  # characters do split
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    for seed in range(6):
        detokenizer = IncrementalDetokenizer(tokenizer)
        pieces = [detokenizer.add(chunk) for chunk in chunked(tokens, seed)]
        assert "".join(pieces) + detokenizer.flush() == whole
        assert all("\ufffd" not in piece for piece in pieces) or make is tiny_tokenizer
        deltas, accumulator = streamed(tokenizer, chunked(tokens, seed))
        assert "".join(deltas) == accumulator.text == whole and accumulator.tokens == tokens


def test_an_unfinished_character_comes_out_as_the_whole_decode_does():
    tokenizer = byte_level_tokenizer()
    tokens = ids(tokenizer, "ab 你好")[:-1]  # the last character lacks its final byte
    deltas, accumulator = streamed(tokenizer, [[t] for t in tokens])
    assert "".join(deltas) == accumulator.text == tokenizer.decode(tokens) and accumulator.text.endswith("\ufffd")


@pytest.mark.parametrize("stop", [["你好"], ["wörld", "🙂"], ["é"], ["the end", "日本語の"], ["never there"]])
@pytest.mark.parametrize("make", [byte_level_tokenizer, byte_fallback_tokenizer])
def test_stop_strings_across_split_characters(make, stop):
    tokenizer = make()
    tokens = ids(tokenizer, MULTIBYTE)
    want_text, want_tokens = reference(tokenizer, tokens, stop)
    for seed in range(4):
        deltas, accumulator = streamed(tokenizer, chunked(tokens, seed), stop)
        assert "".join(deltas) == accumulator.text == want_text  # so no delta ran past the cut
        assert accumulator.tokens == want_tokens and accumulator.stopped == (stop != ["never there"])


@pytest.mark.parametrize("stop", [None, ["never there"]])
@pytest.mark.parametrize("make", [byte_level_tokenizer, byte_fallback_tokenizer, tiny_tokenizer])
def test_tokens_decoded_per_round_are_linear_in_the_output(make, stop, monkeypatch):
    tokenizer = make()
    text = MULTIBYTE if make is not tiny_tokenizer else " ".join(f"w{i % 80}" for i in range(60))
    tokens = ids(tokenizer, text) * 40
    decoded = []
    real = tokenizer.decode

    def counting(token_ids, **options):
        decoded.append(len(token_ids))
        return real(token_ids, **options)

    monkeypatch.setattr(tokenizer, "decode", counting)
    deltas, accumulator = streamed(tokenizer, chunked(tokens, seed=0), stop)
    monkeypatch.undo()
    assert "".join(deltas) == tokenizer.decode(tokens)
    assert sum(decoded) <= 8 * len(tokens), f"{sum(decoded)} tokens decoded for {len(tokens)}"
