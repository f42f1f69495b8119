"""`--drafter PATH` resolves every checkpoint family through one registry, and each one drafts
losslessly in the real loop."""

import pytest
import torch
from conftest import hf_greedy, tiny_model

from dspark.drafters import load_drafter
from dspark.drafters.checkpoint import save_pretrained
from dspark.drafters.draft_lm import DraftLMDrafter
from dspark.drafters.dspark import DSparkModel
from dspark.drafters.dspark_config import DSparkConfig
from dspark.drafters.dspark_drafter import DSparkDrafter
from dspark.drafters.eagle3 import Eagle3Drafter, Eagle3Model
from dspark.drafters.mtp import MTPDrafter, MTPModel
from dspark.errors import DrafterLoadError
from dspark.generation import speculative_decode
from dspark.sampling import SamplingParams
from dspark.target import Target


def write_checkpoint(kind: str, target, path) -> type:
    if kind in ("dspark", "dflash"):
        head = "vanilla" if kind == "dspark" else None
        config = DSparkConfig.for_target(target.config, num_hidden_layers=1, markov_rank=8, block_size=5,
                                         mask_token_id=3, markov_head_type=head)
        save_pretrained(DSparkModel(config, target.get_input_embeddings(), target.get_output_embeddings()), path)
        return DSparkDrafter
    if kind == "eagle3":
        Eagle3Model.for_target(target, num_speculative_tokens=5).save_pretrained(path)
        return Eagle3Drafter
    if kind == "mtp":
        MTPModel.for_target(target, num_modules=2, num_speculative_tokens=5).save_pretrained(path)
        return MTPDrafter
    tiny_model("llama", seed=9).save_pretrained(path)
    return DraftLMDrafter


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "mtp", "draft_lm"])
def test_every_checkpoint_family_loads_and_is_lossless(tmp_path, kind):
    target = tiny_model("llama", seed=2, num_layers=4)
    expected_type = write_checkpoint(kind, target, tmp_path)
    drafter = load_drafter(str(tmp_path), target, draft_dtype=torch.float32)
    assert isinstance(drafter, expected_type)
    prompt = torch.arange(4, 16)
    chunks = speculative_decode(Target(target, drafter.target_layer_ids), drafter, prompt, max_new_tokens=24,
                                sampling=SamplingParams(), generator=None, block_size=5)
    assert [t for c in chunks for t in c] == hf_greedy(target, prompt, 24)


def test_corrupt_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{ nope")
    with pytest.raises(DrafterLoadError, match="not valid JSON"):
        load_drafter(str(tmp_path), tiny_model("llama"))
