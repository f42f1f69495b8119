"""Training data: ShareGPT recovery, code prompts, dedup, eval exclusion, JSONL errors, resumable regeneration."""

import argparse
import io
import itertools
import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dspark.errors import DsparkError
from dspark.train.advanced_math_prompts import TEMPLATES as ADVANCED_TEMPLATES
from dspark.train.advanced_math_prompts import _linear, _poly, advanced_math_prompts
from dspark.train.cli_data import add_data_parser
from dspark.train.data import DataError, EvalIndex, Prompt, select_prompts
from dspark.train.math_prompts import STEP_BY_STEP, TEMPLATES, math_prompts
from dspark.train.prompt_sources import (
    build_prompts,
    code_prompts,
    code_task_prompts,
    iter_json_array,
    read_jsonl_prompts,
    sharegpt_prompts,
)
from dspark.train.regenerate import SamplingConfig, completed_ids, regenerate
from dspark.train.writing_prompts import CLEAN_SENTENCES, writing_prompts
from dspark.train.writing_prompts import TEMPLATES as WRITING_TEMPLATES


def conversation(i: int, first: str = "human", text: str | None = None) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": first, "value": text or f"question {i} é"},
                                             {"from": "gpt", "value": f"answer {i} {{[\"tricky\"]}}"}]}


def truncated_sharegpt(count: int = 5, cut_in: int = 3) -> str:
    """A ShareGPT-style JSON array cut in the middle of item `cut_in`, like the packaged file."""
    text = json.dumps([conversation(i) for i in range(count)], indent=2, ensure_ascii=False)
    start = text.index(f'"c{cut_in}"')
    return text[: start + 40]


@pytest.mark.parametrize("chunk_size", [7, 1 << 20])
def test_truncated_json_array_recovers_complete_items(chunk_size):
    items = list(iter_json_array(io.StringIO(truncated_sharegpt()), chunk_size=chunk_size))
    assert items == [conversation(i) for i in range(3)]


def test_complete_json_array_and_non_array():
    text = json.dumps([conversation(i) for i in range(4)] + [1, 23, "x"])
    assert list(iter_json_array(io.StringIO(text), chunk_size=3)) == [conversation(i) for i in range(4)] + [1, 23, "x"]
    with pytest.raises(DataError, match="not a JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}')))


def test_sharegpt_prompts_skip_empty_long_and_non_human():
    records = [conversation(0), conversation(1, text="   "), conversation(2, first="gpt"),
               conversation(3, text="x" * 50), conversation(4)]
    text = json.dumps(records)[:-30]  # truncated inside the last record
    prompts = sharegpt_prompts(max_chars=20, stream=io.StringIO(text))
    assert [p.id for p in prompts] == ["sharegpt/c0"]
    assert prompts[0].messages == [{"role": "user", "content": "question 0 é"}]


def test_code_prompts_deterministic_given_seed(tmp_path):
    for k in range(4):
        body = "\n".join(f"    x{j} = {j}" for j in range(5))
        (tmp_path / f"mod{k}.py").write_text(
            f'def f{k}(a, b=1):\n    """Doc {k}."""\n{body}\n    return a\n\n\n'
            f"class C{k}:\n    def m(self):\n{body.replace('    ', '        ')}\n        return 1\n"
        )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "skipped.py").write_text("def g():\n    a = 1\n    b = 2\n    return a\n")
    first = [p.to_json() for p in code_prompts(seed=1, root=tmp_path)]
    assert first == [p.to_json() for p in code_prompts(seed=1, root=tmp_path)]
    assert [p["id"] for p in first] != [p.id for p in code_prompts(seed=2, root=tmp_path)]
    assert len(first) == 12 and not any("skipped" in p["id"] for p in first)
    assert all("```python\n" in p["messages"][0]["content"] for p in first)


def test_code_prompts_from_real_stdlib():
    prompts = list(itertools.islice(code_prompts(seed=0), 5))
    assert len(prompts) == 5 and all(p.source == "code" for p in prompts)


def test_code_task_prompts_are_function_tasks_from_documented_functions(tmp_path):
    (tmp_path / "mod.py").write_text(
        'def area(width, height):\n    """Returns the area of a rectangle of the given sides."""\n'
        "    a = width\n    b = height\n    return a * b\n\n\n"
        "def undocumented(x):\n    y = x\n    z = y\n    return z\n"
    )
    prompts = list(code_task_prompts(seed=0, root=tmp_path))
    assert [p.id.rsplit("/", 1)[0] for p in prompts] == ["code-task/mod.area"]  # the undocumented one gives none
    texts = {template: None for template in ("solve", "describe", "short")}
    for seed in range(12):  # every template applies to this docstring
        for prompt in code_task_prompts(seed=seed, root=tmp_path):
            texts[prompt.id.rsplit("/", 1)[1]] = prompt.messages[0]["content"]
    assert '```python\ndef area(width, height):\n    """Returns the area' in texts["solve"]
    assert texts["describe"].startswith("Write a Python function `area(width, height)` that does the following: "
                                        "Returns the area")
    assert texts["short"] == "Write a python function to return the area of a rectangle of the given sides."


def test_math_prompts_are_a_finite_seeded_pool_over_every_template():
    pool = list(math_prompts(seed=3, per_template=5))
    assert len(pool) == 5 * len(TEMPLATES) and len({p.id for p in pool}) == len(pool)
    assert [p.to_json() for p in pool] == [p.to_json() for p in math_prompts(seed=3, per_template=5)]
    assert [p.id for p in pool] != [p.id for p in math_prompts(seed=4, per_template=5)]
    assert {p.id.split("/")[1] for p in pool} == set(TEMPLATES)
    assert all(p.source == "math" and p.messages[0]["content"].strip() for p in pool)
    with_instruction = sum(p.messages[0]["content"].endswith(STEP_BY_STEP) for p in pool)
    assert 0.6 * len(pool) < with_instruction < len(pool)  # most ask for a boxed answer, some are asked plainly


def test_build_prompts_mixes_maths_and_code_tasks_and_excludes_eval_matches(tmp_path):
    taken = next(iter(math_prompts(seed=0))).messages[0]["content"]
    eval_file = write_jsonl(tmp_path / "eval.jsonl", [{"turns": [taken]}])
    prompts, report = build_prompts(maths=30, code_tasks=5, exclude=[eval_file])
    assert report.sources["math"].kept == 30 and report.sources["math"].excluded == 1
    assert report.sources["code-task"].kept == 5
    assert taken not in {p.messages[0]["content"] for p in prompts}
    sources = [p.source for p in prompts]
    assert sources.count("math") == 30 and sources.count("code-task") == 5


def test_advanced_math_prompts_are_a_seeded_pool_whose_prompts_depend_only_on_their_ids():
    pool = list(advanced_math_prompts(seed=3, per_template=5))
    assert len(pool) == 5 * len(ADVANCED_TEMPLATES) and len({p.id for p in pool}) == len(pool)
    assert [p.to_json() for p in pool] == [p.to_json() for p in advanced_math_prompts(seed=3, per_template=5)]
    assert {p.id.split("/")[1] for p in pool} == set(ADVANCED_TEMPLATES)
    assert all(p.source == "math-advanced" and p.id.startswith("math-advanced/") for p in pool)
    texts = [p.messages[0]["content"] for p in pool]
    in_latex = sum("$" in text or "\\[" in text for text in texts)
    assert in_latex > 0.8 * len(texts)  # set in LaTeX as competition problems are; word problems stay plain
    assert any("\\[" in text for text in texts) and any("[asy]" in text for text in texts)
    # a larger pool adds prompts without changing the ones already drawn (the corpus keeps only ids)
    larger = {p.id: p.messages[0]["content"] for p in advanced_math_prompts(seed=3, per_template=9)}
    assert all(larger[p.id] == p.messages[0]["content"] for p in pool)
    assert {p.id: p for p in advanced_math_prompts(seed=4, per_template=5)}.keys().isdisjoint(larger)


def test_polynomials_are_written_as_a_person_would():
    assert _poly([2, 0, -3, 1]) == "2x^3 - 3x + 1"
    assert _poly([-1, 1, 0]) == "-x^2 + x"
    assert _poly([0, 0, 5]) == "5" and _poly([0, 0]) == "0"
    assert _poly([1] + [0] * 10, "t") == "t^{10}"
    assert _linear((-1, 2, 0)) == "-x + 2y" and _linear((3, -1, 1)) == "3x - y + z" and _linear((0, 0, 0)) == "0"


def test_build_prompts_takes_advanced_maths_and_excludes_eval_matches(tmp_path):
    taken = next(iter(advanced_math_prompts(seed=0))).messages[0]["content"]
    eval_file = write_jsonl(tmp_path / "eval.jsonl", [{"turns": [taken]}])
    prompts, report = build_prompts(maths=5, advanced_maths=20, exclude=[eval_file])
    assert report.sources["math-advanced"].kept == 20 and report.sources["math-advanced"].excluded == 1
    assert taken not in {p.messages[0]["content"] for p in prompts}
    assert [p.source for p in prompts].count("math-advanced") == 20


def test_writing_prompts_are_a_finite_seeded_pool_over_every_template():
    pool = list(writing_prompts(seed=3, per_template=4))
    assert len(pool) == 4 * len(WRITING_TEMPLATES) and len({p.id for p in pool}) == len(pool)
    assert [p.to_json() for p in pool] == [p.to_json() for p in writing_prompts(seed=3, per_template=4)]
    assert [p.to_json() for p in pool] != [p.to_json() for p in writing_prompts(seed=4, per_template=4)]
    assert {p.id.split("/")[1] for p in pool} == set(WRITING_TEMPLATES)
    texts = [p.messages[0]["content"] for p in pool]
    assert all(p.source == "writing" and p.messages[0]["role"] == "user" for p in pool)
    assert all(text.strip() and "{" not in text and "}" not in text for text in texts)  # every field filled in
    clean = {" ".join(pair) for pair in itertools.permutations(CLEAN_SENTENCES, 2)}
    proofread = [p.messages[0]["content"] for p in pool if p.id.split("/")[1] == "proofread"]
    assert proofread and all(text.split("\n", 1)[1] not in clean for text in proofread)  # mistakes put in


def test_build_prompts_takes_writing_requests_and_excludes_eval_matches(tmp_path):
    taken = next(iter(writing_prompts(seed=0))).messages[0]["content"]
    eval_file = write_jsonl(tmp_path / "eval.jsonl", [{"turns": [taken]}])
    prompts, report = build_prompts(writing=40, exclude=[eval_file])
    assert report.sources["writing"].kept == 40 and report.sources["writing"].excluded == 1
    assert taken not in {p.messages[0]["content"] for p in prompts}
    assert len({p.messages[0]["content"] for p in prompts}) == 40  # repeated draws are dropped


def test_dedup_on_normalised_text():
    prompts = [Prompt(f"p{i}", "t", [{"role": "user", "content": text}])
               for i, text in enumerate(["Hello  World", "hello world\n", "other", "HELLO world"])]
    selected, report = select_prompts([("t", prompts, None)])
    assert sorted(p.id for p in selected) == ["p0", "p2"]
    assert report.sources["t"].duplicates == 2


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


EVAL_LONG = "Write a function to find the shared elements from the given two lists and return them sorted."


def test_exclusion_against_eval_file(tmp_path):
    eval_file = write_jsonl(tmp_path / "eval.jsonl", [{"turns": [EVAL_LONG, "Now make it faster."]},
                                                      {"turns": ["Short one."]}])
    train = write_jsonl(tmp_path / "train.jsonl", [
        {"turns": [EVAL_LONG.upper()]},                                  # exact after normalisation
        {"turns": [f"Hi there! {EVAL_LONG} Please use Python 3."]},      # eval prompt contained
        {"turns": ["EVAL: " + EVAL_LONG.replace("sorted", "ordered")]},  # light edit, large overlap
        {"turns": ["short   ONE."]},                                     # exact short turn
        {"turns": ["now make it faster."]},                              # later eval turns count too
        {"turns": ["Write a function to reverse a linked list in place and explain its complexity."]},
        {"turns": ["Short one, but a different and longer request about baking sourdough bread at home."]},
    ])
    prompts, report = build_prompts(jsonl=[train], exclude=[eval_file])
    assert sorted(p.id for p in prompts) == ["train:6", "train:7"]
    assert report.excluded == 5


def test_an_instruction_the_eval_set_repeats_is_not_contamination():
    instruction = "Please reason step by step, and put your final answer within \\boxed{}."
    questions = [f"What is the remainder when {7 + i} to the power {100 + i} is divided by {3 + i} exactly?"
                 for i in range(6)]
    index = EvalIndex([f"{q}\n{instruction}" for q in questions])
    new_question = f"Solve 3x + 5 = 7.\n{instruction}"  # mostly the instruction's n-grams
    assert not index.matches(new_question)
    assert index.matches(f"{questions[2]}\n{instruction}")     # an eval prompt itself
    assert index.matches(f"Hello! {questions[4]} Thanks.")         # its question without the instruction
    few = EvalIndex([f"{q}\n{instruction}" for q in questions[:2]])  # below `boilerplate` turns it is content
    assert few.matches(new_question)


def test_eval_index_overlap_both_directions():
    index = EvalIndex([EVAL_LONG])
    assert index.matches("find the shared elements from the given two lists and return them")  # train inside eval
    assert not index.matches("find the shared elements from two lists")


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"text": "hi"}', '"turns" or a "messages"'),
    ('{"turns": []}', "non-empty list of strings"),
    ('{"turns": ["  "]}', "first turn is empty"),
    ('{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}', "assistant message"),
    ('{"messages": [{"role": "robot", "content": "a"}]}', '"role"'),
    ('{"messages": [{"role": "system", "content": "a"}]}', "no user message"),
    ("[1, 2]", "expected an object"),
])
def test_user_jsonl_errors(tmp_path, line, message):
    path = write_jsonl(tmp_path / "user.jsonl", [{"turns": ["fine"]}, line])
    with pytest.raises(DataError, match=message) as error:
        read_jsonl_prompts(path)
    assert f"{path}:2" in str(error.value) and "\n" not in str(error.value)


def test_user_jsonl_formats_and_ids(tmp_path):
    path = write_jsonl(tmp_path / "u.jsonl", [
        {"turns": ["first", "second"]}, '"a bare string"', "",
        {"id": 7, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                               {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]},
    ])
    prompts = read_jsonl_prompts(path)
    assert [p.id for p in prompts] == ["u:1", "u:2", "7"]
    assert prompts[0].messages == [{"role": "user", "content": "first"}]
    assert prompts[2].messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]
    duplicate = write_jsonl(tmp_path / "d.jsonl", [{"id": 1, "turns": ["a"]}, {"id": 1, "turns": ["b"]}])
    with pytest.raises(DataError, match="duplicate id"):
        read_jsonl_prompts(duplicate)
    with pytest.raises(DataError, match="file not found"):
        read_jsonl_prompts(tmp_path / "missing.jsonl")


def run_cli(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="dspark")
    add_data_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.handler(args)


def test_cli_prompts(tmp_path, capsys):
    user = write_jsonl(tmp_path / "user.jsonl", [{"turns": ["alpha"]}, {"turns": ["Alpha "]}, {"turns": [EVAL_LONG]}])
    eval_file = write_jsonl(tmp_path / "eval.jsonl", [{"turns": [EVAL_LONG]}])
    out = tmp_path / "prompts.jsonl"
    run_cli(["data", "prompts", "--jsonl", user, "--exclude", eval_file, eval_file, "--out", str(out)])
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["user:1"]
    assert "1 dropped as evaluation matches" in capsys.readouterr().err
    with pytest.raises(DsparkError, match="no prompt source"):
        run_cli(["data", "prompts", "--out", str(out)])
    run_cli(["data", "prompts", "--writing", "12", "--exclude", eval_file, "--out", str(out)])
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == 12 and {row["source"] for row in written} == {"writing"}
    run_cli(["data", "prompts", "--math-advanced", "7", "--out", str(out)])
    assert {json.loads(line)["source"] for line in out.read_text().splitlines()} == {"math-advanced"}


# ---------------------------------------------------------------- regeneration with a tiny random model

WORDS = [f"w{i}" for i in range(80)]
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<user>", "<assistant>", "<system>"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama(tokenizer: PreTrainedTokenizerFast, eos_logit: float | None = None) -> LlamaForCausalLM:
    """A random 2-layer Llama. A random model almost never emits EOS; with `eos_logit`, the EOS row of
    the LM head points along the mean final hidden state so that EOS gets about that logit (others are
    ~±0.4): sampled answers then end at varied lengths."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    if eos_logit is not None:
        with torch.no_grad():
            ids = torch.randint(len(SPECIALS), len(tokenizer), (8, 16))
            hidden = model(ids, output_hidden_states=True).hidden_states[-1].reshape(-1, config.hidden_size).mean(0)
            model.lm_head.weight[2] = eos_logit * hidden / hidden.dot(hidden)
    return model


def tiny_prompts(count: int = 11) -> list[Prompt]:
    return [Prompt(f"p{i}", "test", [{"role": "user", "content": " ".join(WORDS[i : i + 1 + i % 5])}])
            for i in range(count)]


def read_samples(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("batch_size, sampling, eos_logit", [
    (1, SamplingConfig(0.0, 1.0, 6), None),  # greedy: the resumed file must equal an uninterrupted run
    (3, SamplingConfig(1.0, 0.9, 6), 3.0),  # sampled, ragged batches, answers ending at EOS or at the limit
])
def test_regenerate_resumes_after_kill_without_loss_or_duplicates(tmp_path, batch_size, sampling, eos_logit):
    tokenizer, prompts = tiny_tokenizer(), tiny_prompts()
    model = tiny_llama(tokenizer, eos_logit)
    reference_path = tmp_path / "reference.jsonl"
    stats = regenerate(prompts, reference_path, model, tokenizer, sampling, batch_size=batch_size, window=4)
    reference = read_samples(reference_path)
    assert stats.generated == len(prompts) and sorted(s["id"] for s in reference) == sorted(p.id for p in prompts)
    assert all(s["messages"][:-1] == next(p.messages for p in prompts if p.id == s["id"]) for s in reference)
    assert all(s["messages"][-1]["role"] == "assistant" and s["num_tokens"] <= 6 for s in reference)
    for sample in reference:
        assert tokenizer.decode(sample["answer_ids"], skip_special_tokens=True) == sample["messages"][-1]["content"]
        body = sample["answer_ids"][:-1] if sample["finished"] else sample["answer_ids"]
        assert 2 not in body and (not sample["finished"] or sample["answer_ids"][-1] == 2)
        assert len(sample["answer_ids"]) == sample["num_tokens"] + sample["finished"]
        prompt = next(p for p in prompts if p.id == sample["id"])
        assert sample["prompt_ids"] == tokenizer(tokenizer.apply_chat_template(
            prompt.messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    if eos_logit is not None:
        assert {s["finished"] for s in reference} == {True, False}
        assert all(s["finished"] == (s["num_tokens"] < 6) for s in reference)

    # a kill in the middle of writing line 6 leaves 5 whole lines and half of one
    killed = tmp_path / "killed.jsonl"
    lines = reference_path.read_text().splitlines(keepends=True)
    killed.write_text("".join(lines[:5]) + lines[5][: len(lines[5]) // 2])
    assert completed_ids(killed) == {s["id"] for s in reference[:5]}
    assert killed.read_text() == "".join(lines[:5])

    stats = regenerate(prompts, killed, model, tokenizer, sampling, batch_size=batch_size, limit=2, window=4)
    assert (stats.done_before, stats.generated) == (5, 2)
    stats = regenerate(prompts, killed, model, tokenizer, sampling, batch_size=batch_size, window=4)
    assert (stats.done_before, stats.generated) == (7, len(prompts) - 7)
    resumed = read_samples(killed)
    assert len(resumed) == len(prompts) and {s["id"] for s in resumed} == {p.id for p in prompts}
    assert resumed[:5] == reference[:5]
    if sampling.temperature == 0 and batch_size == 1:  # greedy, no padding: the very same answers
        assert sorted(resumed, key=lambda s: s["id"]) == sorted(reference, key=lambda s: s["id"])
    assert regenerate(prompts, killed, model, tokenizer, sampling, batch_size=batch_size).generated == 0


def test_regenerate_refuses_a_foreign_output_file(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "p0"}\nnot json\n')
    with pytest.raises(DataError, match="out.jsonl:2"):
        completed_ids(out)


def test_length_grouped_batches_cut_padding_and_keep_every_sample_once():
    """group_by_length: a batch holds samples of similar length, every sample still comes once an epoch in
    a seeded order that changes between epochs, and a batch is a function of (seed, step) (exact resume)."""
    from dspark.train.examples import batch_indices

    lengths = torch.randint(20, 1024, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    batch, per_epoch = 4, 250

    def epoch(first_step, **grouping):
        return [batch_indices(1000, batch, step, 3, **grouping) for step in range(first_step, first_step + per_epoch)]

    def padded_share(batches):
        return sum(max(lengths[i] for i in b) * len(b) for b in batches) / sum(lengths[i] for b in batches for i in b)

    plain, grouped = epoch(0), epoch(0, lengths=lengths, group_batches=32)
    assert sorted(i for b in grouped for i in b) == list(range(1000))
    assert padded_share(plain) > 1.2 and padded_share(grouped) < 1.05
    assert epoch(0, lengths=lengths, group_batches=1) == plain == epoch(0, group_batches=32)  # off: the plain order
    assert batch_indices(1000, batch, 17, 3, lengths, 32) == grouped[17]
    next_epoch = epoch(per_epoch, lengths=lengths, group_batches=32)
    assert sorted(i for b in next_epoch for i in b) == list(range(1000)) and next_epoch != grouped
    assert {len(b) for b in grouped} == {batch}


def test_length_grouping_must_not_be_negative():
    from dspark.train.config import TrainConfig

    with pytest.raises(DsparkError, match="length_grouping"):
        TrainConfig(data="c.safetensors", length_grouping=-1)
