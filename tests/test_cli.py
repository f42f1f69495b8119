"""Bad input: one-line error, non-zero exit, no traceback."""

import subprocess
import sys

import pytest
from conftest import tiny_model

from dspark.cli import main


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    """A tiny random Llama saved as an HF directory (no tokenizer: prompts are refused politely)."""
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama").save_pretrained(path)
    return path


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv, message", [
    (["generate", "   "], "prompt is empty"),
    (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens must be > 0"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be"),
    (["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--target", "/nonexistent/model"], "target path not found"),
    (["generate", "hi", "--target", "/nonexistent/model.gguf"], "GGUF file not found"),
    (["generate", "hi", "--scheduler", "sometimes"], "unknown scheduler"),
])
def test_bad_generate_arguments(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["train", "--score", "--resume", "data=c.safetensors", "init_from=d"], "--score and --resume exclude"),
    (["train", "--score", "data=c.safetensors"], "set init_from=CHECKPOINT"),
])
def test_bad_score_arguments(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.startswith("error: ") and message in err


@pytest.mark.parametrize("argv, resume, output_dir", [
    (["--resume", "output_dir=runs/x", "data=c.jsonl"], "latest", "runs/x"),  # the override is not a checkpoint
    (["data=c.jsonl", "output_dir=runs/x", "--resume"], "latest", "runs/x"),
    (["--resume", "CHECKPOINT", "output_dir=runs/y", "data=c.jsonl"], "CHECKPOINT", "runs/y"),
])
def test_resume_before_an_override_resumes_the_newest_checkpoint(capsys, monkeypatch, tmp_path, argv, resume,
                                                                 output_dir):
    calls = []
    monkeypatch.setattr("dspark.train.trainer.train", lambda config, resume: calls.append((config, resume)) or {})
    checkpoint = tmp_path / "checkpoint-0000002"
    checkpoint.mkdir()
    argv = [str(checkpoint) if arg == "CHECKPOINT" else arg for arg in argv]
    code, _, err = run_cli(capsys, "train", *argv)
    assert code == 0, err
    (config, got), = calls
    assert got == (str(checkpoint) if resume == "CHECKPOINT" else resume) and config.output_dir == output_dir


def test_corrupt_target_directory(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    code, _, err = run_cli(capsys, "generate", "hi", "--target", str(tmp_path))
    assert code == 2 and "could not load target" in err


def test_target_directory_without_config(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "hi", "--target", str(tmp_path))
    assert code == 2 and "no config.json" in err


def test_truncated_weights_are_refused(capsys, tmp_path, tiny_target_dir):
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tiny_target_dir / name).read_bytes())
    weights = (tiny_target_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    code, _, err = run_cli(capsys, "generate", "hi", "--target", str(tmp_path))
    assert code == 2 and "could not load target" in err


def test_drafter_with_other_vocabulary_is_refused(capsys, tmp_path, tiny_target_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    code, _, err = run_cli(capsys, "generate", "hi", "--target", str(tiny_target_dir), "--drafter", str(tmp_path))
    assert code == 2 and "vocabulary of 50 tokens but the target has 96" in err


def test_unknown_drafter(capsys, tiny_target_dir):
    code, _, err = run_cli(capsys, "generate", "hi", "--target", str(tiny_target_dir), "--drafter", "nope")
    assert code == 2 and "drafter must be none, ngram, default" in err


def test_subprocess_exit_code_and_no_traceback():
    result = subprocess.run([sys.executable, "-m", "dspark.cli", "generate", "", "--drafter", "none"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: prompt is empty"


def test_bench_bad_dataset(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\nnot json\n')
    from dspark.eval.datasets import load_prompts

    assert load_prompts(bad, 1) == ["ok"]
    code, _, err = run_cli(capsys, "bench", "speed", "--dataset", str(tmp_path / "missing.jsonl"),
                           "--target", "/nonexistent/x")
    assert code == 2 and err.startswith("error: ")
