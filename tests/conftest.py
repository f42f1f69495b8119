import json
import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 96
EOS = 2


def tiny_model(arch: str, seed: int = 0, num_layers: int = 2):
    """A tiny random causal LM of the given family, fp32, eval mode."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    if arch == "llama":
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                             num_attention_heads=4, num_key_value_heads=2, **common)
        model = LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                             num_attention_heads=4, num_key_value_heads=2, **common)
        model = Qwen2ForCausalLM(config)
    elif arch == "qwen3":
        config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, **common)
        model = Qwen3ForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=num_layers, n_head=4, n_positions=256, **common)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(arch)
    _sharpen(model)
    model.generation_config.eos_token_id = None  # tests opt in to EOS; random models hit it early
    model.generation_config.pad_token_id = 0
    return model.eval()


def _sharpen(model) -> None:
    """Random init gives near-uniform logits; scaling the LM head makes greedy choices well separated
    (so float reordering between chunked and token-by-token forwards cannot flip an argmax)."""
    with torch.no_grad():
        head = model.get_output_embeddings()
        if head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr():
            model.config.tie_word_embeddings = False
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
        head.weight.mul_(20.0)


def pytest_configure(config) -> None:
    """Under pytest-xdist (`-n`), each worker takes its share of the cores: two workers each running
    the real model on every core would oversubscribe them, which costs far more than it saves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request):
    """Tiny models run faster on one thread (and leave the other core to parallel work); the real
    default model keeps this worker's threads."""
    threads = torch.get_num_threads()
    if request.node.get_closest_marker("real_model") is None:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def cpu_without_native_bf16():
    """`--dtype auto` means float32 in every test, whatever this CPU has, so results do not depend on the
    machine (session-wide, so module fixtures that load targets see it too); the tests of the auto
    choice mock the CPU's flags themselves."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("dspark.loading.read_cpuinfo", lambda: "")
        yield


@pytest.fixture(params=["llama", "qwen2", "qwen3", "gpt2"])
def tiny_target(request):
    return tiny_model(request.param)


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                                max_new_tokens=max_new_tokens, do_sample=False)
    return output[0, prompt.shape[0]:].tolist()


# ----------------------------------------------------------------------- tiny models on disk

WORDS = [f"w{i}" for i in range(80)]
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<user>", "<assistant>"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
TINY_GAMMA = 4


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over w0..w79 with a chat template: decoding is exact, so text-level
    tests (stop strings, streaming) are easy to reason about."""
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def tiny_on_disk(tmp_path_factory):
    """A tiny random Llama target with a tokenizer, a random DSpark drafter and two prompt files."""
    from dspark.drafters.checkpoint import save_pretrained
    from dspark.drafters.dspark import DSparkModel
    from dspark.drafters.dspark_config import DSparkConfig

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    _sharpen(target)  # well-separated greedy choices: batched and single-request runs must agree exactly
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    config = DSparkConfig.for_target(target.config, num_hidden_layers=1, markov_rank=8, block_size=TINY_GAMMA)
    model = DSparkModel(config, target.get_input_embeddings(), target.get_output_embeddings())
    model.init_weights(std=0.3)  # confidences spread well away from 0.5
    save_pretrained(model, root / "drafter", dtype=torch.float32)
    for name, count in (("gsm8k", 3), ("mbpp", 2)):
        lines = [json.dumps({"turns": [" ".join(WORDS[i : i + 3 + i % 4])]}) for i in range(count)]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return root
