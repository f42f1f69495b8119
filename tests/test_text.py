"""Incremental detokenisation with stop strings (shared by `stream` and the server)."""

from conftest import tiny_tokenizer

from dspark.api import TextAccumulator


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
