"""The embedded default target (SmolLM2-135M-Instruct): fetched, converted once, lossless with ngram."""

import json
from pathlib import Path

import pytest
import torch

from dspark.api import generate, prompt_ids
from dspark.cli import main
from dspark.loading import load_target

pytestmark = pytest.mark.real_model
EVAL_DIR = Path(__file__).resolve().parents[2] / "shared" / "eval_datasets"


@pytest.fixture(scope="module")
def default_target():
    return load_target("default")


def prompts() -> list[str]:
    fallback = ["Write a Python function that reverses a string.", "What is 12 * 13? Explain step by step."]
    if not (EVAL_DIR / "humaneval.jsonl").is_file():
        return fallback
    from dspark.eval.datasets import load_prompts

    return load_prompts(EVAL_DIR / "humaneval.jsonl", 1) + load_prompts(EVAL_DIR / "math500.jsonl", 1) + fallback[:1]


def hf_reference(loaded, ids, max_new_tokens):
    with torch.inference_mode():
        out = loaded.model.generate(ids[None], attention_mask=torch.ones_like(ids[None]),
                                    max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)
    return out[0, ids.shape[0]:].tolist()


@pytest.mark.parametrize("drafter", ["ngram", "none"])
def test_default_model_greedy_equals_hf(default_target, drafter):
    for prompt in prompts():
        ids = prompt_ids(default_target, prompt)
        reference = hf_reference(default_target, ids, 48)
        result = generate(prompt, target=default_target, drafter=drafter, max_new_tokens=48)
        assert result.token_ids == reference
        assert result.text == default_target.tokenizer.decode(reference, skip_special_tokens=True)


def test_cli_json_line_last(capsys, default_target):
    prompt = "Write a Python function that reverses a string."
    assert main(["generate", prompt, "--drafter", "ngram", "--max-new-tokens", "200", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    record = json.loads(last)
    reference = hf_reference(default_target, prompt_ids(default_target, prompt), 200)
    assert record["token_ids"] == reference and reference[-1] == 2  # EOS included, as HF returns it
    assert record["num_rounds"] < len(reference) and record["tau"] > 1.0
    assert {"text", "tokens_per_s"} <= record.keys()


def test_stream_equals_generate_and_stop_strings(default_target):
    from dspark.api import stream

    prompt = "List the numbers from 1 to 12, one per line."
    handle = stream(prompt, target=default_target, drafter="ngram", max_new_tokens=80)
    streamed = "".join(handle)
    full = generate(prompt, target=default_target, drafter="ngram", max_new_tokens=80)
    assert streamed == full.text == handle.result.text
    stopped = generate(prompt, target=default_target, drafter="ngram", max_new_tokens=80, stop=["5"])
    assert stopped.finish_reason == "stop" and "5" not in stopped.text
    assert full.text.startswith(stopped.text)
    decoded = default_target.tokenizer.decode(stopped.token_ids, skip_special_tokens=True)
    assert "5" in decoded and "5" not in default_target.tokenizer.decode(stopped.token_ids[:-1])


def test_converted_cache_reloads_fast(default_target):
    import time

    start = time.perf_counter()
    load_target("default")
    assert time.perf_counter() - start < 10.0  # the GGUF conversion (~20 s) happens once only


def test_shipped_drafter_is_lossless_and_calibrated(default_target):
    """The default drafter: a real DSpark checkpoint (fp16, no embeddings), calibrated by sequential Platt scaling
    at T = 0 and T = 1 (temperatures and biases)."""
    from dspark.drafters import SHIPPED_DRAFTER, load_drafter
    from dspark.drafters.dspark_drafter import DSparkDrafter

    drafter = load_drafter("default", default_target.model)
    assert isinstance(drafter, DSparkDrafter)
    assert drafter.config.calibration_temperatures and len(drafter.config.calibration_temperatures) == 7
    assert set(drafter.config.calibration_biases_by_sampling) == {0.0, 1.0}
    assert (SHIPPED_DRAFTER / "model.safetensors").stat().st_size < 40e6
    for prompt in prompts()[:2]:
        ids = prompt_ids(default_target, prompt)
        reference = hf_reference(default_target, ids, 48)
        # "fixed" verifies every draft: the default scheduler may verify none on a slow, busy CPU
        for scheduler in ("dspark", "fixed"):
            result = generate(prompt, target=default_target, drafter=drafter, max_new_tokens=48, scheduler=scheduler)
            assert result.token_ids == reference
        assert result.stats.position_attempts[0] > 0


def test_product_default_is_lookup_first_and_lossless(default_target):
    """`generate` without a drafter drafts with the shipped checkpoint plus prompt lookup: HF's greedy output."""
    from dspark.drafters import DEFAULT_DRAFTER, load_drafter
    from dspark.drafters.dspark_drafter import DSparkDrafter
    from dspark.drafters.lookup_first import LookupFirstDrafter

    drafter = load_drafter(DEFAULT_DRAFTER, default_target.model)
    assert isinstance(drafter, LookupFirstDrafter) and isinstance(drafter.model, DSparkDrafter)
    for prompt in prompts()[:2]:
        ids = prompt_ids(default_target, prompt)
        reference = hf_reference(default_target, ids, 64)
        assert generate(prompt, target=default_target, max_new_tokens=64, scheduler="fixed").token_ids == reference
