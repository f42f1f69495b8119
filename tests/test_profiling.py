"""The target's SPS profile is measured once, written to the cache and then reused."""

import pytest
from conftest import tiny_model

from dspark import profiling
from dspark.loading import LoadedTarget


def test_profile_is_measured_once_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(profiling, "_TABLES", {})
    loaded = LoadedTarget(tiny_model("llama"), None, "tiny", None)
    table = profiling.sps_table(loaded, max_tokens=4, context_tokens=16)
    assert table.max_tokens == 4 and all(a >= b for a, b in zip(table.values, table.values[1:], strict=False))
    assert profiling.profile_path(loaded, 16).is_file()

    def no_measuring(*args, **kwargs):
        raise AssertionError("profile measured again")

    monkeypatch.setattr(profiling, "measure_sps", no_measuring)
    assert profiling.sps_table(loaded, max_tokens=3, context_tokens=16) == table  # from memory
    monkeypatch.setattr(profiling, "_TABLES", {})
    assert profiling.sps_table(loaded, max_tokens=4, context_tokens=16) == table  # from the file
    with pytest.raises(AssertionError, match="measured again"):
        profiling.sps_table(loaded, max_tokens=8, context_tokens=16)  # a longer table must be measured


def test_int4_and_dense_targets_have_separate_profiles():
    import torch

    from dspark.quantize import quantize_int4_

    dense = LoadedTarget(tiny_model("llama").to(torch.bfloat16), None, "tiny", None)
    int4 = LoadedTarget(tiny_model("llama").to(torch.bfloat16), None, "tiny", None)
    quantize_int4_(int4.model)
    assert "bfloat16" in profiling.profile_path(dense, 16).name and "int4" in profiling.profile_path(int4, 16).name
    assert "packed" not in profiling.profile_path(int4, 16).name  # int4 layers keep their own kernel


def test_packed_and_plain_bf16_forwards_have_separate_profiles(monkeypatch):
    """Packing the weights (dspark.packed) changes the cost curve, so a profile of the plain forward is not reused."""
    import torch

    dense = LoadedTarget(tiny_model("llama").to(torch.bfloat16), None, "tiny", None)
    monkeypatch.setattr(profiling, "auto_packed", lambda model: True)
    packed = profiling.profile_path(dense, 16).name
    monkeypatch.setattr(profiling, "auto_packed", lambda model: False)
    assert "bfloat16-packed" in packed and profiling.profile_path(dense, 16).name == packed.replace("-packed", "")
