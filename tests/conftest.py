import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
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


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request):
    """Tiny models run faster on one thread (and leave the other core to parallel work); the real
    default model keeps every thread."""
    threads = torch.get_num_threads()
    if request.node.get_closest_marker("real_model") is None:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["llama", "qwen2", "qwen3", "gpt2"])
def tiny_target(request):
    return tiny_model(request.param)


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                                max_new_tokens=max_new_tokens, do_sample=False)
    return output[0, prompt.shape[0]:].tolist()
