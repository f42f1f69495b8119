"""What a round costs is measured once, written to the cache and then reused: the target's step rates per
number of requests, and the drafter's seconds per proposal."""

import pytest
import torch
from conftest import tiny_model
from test_engine import random_dspark

from dspark import profiling
from dspark.factory import build_engine
from dspark.loading import LoadedTarget
from dspark.scheduler import RoundCost, SPSTable


def test_request_counts_are_powers_of_two_and_the_maximum():
    assert profiling.request_counts(1) == [1]
    assert profiling.request_counts(8) == [1, 2, 4, 8]
    assert profiling.request_counts(6) == [1, 2, 4, 6]


def test_profile_is_measured_once_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(profiling, "_COSTS", {})
    loaded = LoadedTarget(tiny_model("llama"), None, "tiny", None)
    cost = profiling.round_cost(loaded, max_requests=2, block_size=1, context_tokens=16)
    assert sorted(cost.verify) == [1, 2]
    assert cost.verify[1].max_tokens == 2 and cost.verify[2].max_tokens == 4  # B up to R·(γ + 1)
    for table in cost.verify.values():
        assert all(a >= b for a, b in zip(table.values, table.values[1:], strict=False))
    assert profiling.profile_path(loaded, 16).is_file()

    def no_measuring(*args, **kwargs):
        raise AssertionError("profile measured again")

    monkeypatch.setattr(profiling, "measure_verify", no_measuring)
    assert profiling.round_cost(loaded, max_requests=1, block_size=1, context_tokens=16) == cost  # from memory
    monkeypatch.setattr(profiling, "_COSTS", {})
    assert profiling.round_cost(loaded, max_requests=2, block_size=1, context_tokens=16) == cost  # from the file
    with pytest.raises(AssertionError, match="measured again"):
        profiling.round_cost(loaded, max_requests=4, block_size=1, context_tokens=16)  # more requests: measured
    with pytest.raises(AssertionError, match="measured again"):
        profiling.round_cost(loaded, max_requests=2, block_size=3, context_tokens=16)  # longer rounds: measured


def test_a_corrupt_profile_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(profiling, "_COSTS", {})
    loaded = LoadedTarget(tiny_model("llama"), None, "tiny", None)
    path = profiling.profile_path(loaded, 16)
    path.parent.mkdir(parents=True)
    path.write_text('{"sps": [1.0, 0.5]}')  # the old one-curve format
    cost = profiling.round_cost(loaded, max_requests=1, block_size=1, context_tokens=16)
    assert RoundCost.from_json(path.read_text()) == cost


def test_dspark_async_engines_price_drafting_once(tmp_path, monkeypatch):
    """build_engine gives dspark-async the drafter's measured seconds per proposal, growing with the number of
    requests; the measurement is cached per drafter configuration and runs on an engine of its own."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(profiling, "_COSTS", {})
    monkeypatch.setattr(profiling, "_DRAFTS", {})
    model = tiny_model("llama", num_layers=3)
    loaded = LoadedTarget(model, None, "tiny", None)
    drafter = random_dspark(model)
    engine = build_engine(loaded, drafter, scheduler="dspark-async", max_concurrency=4, block_size=3)
    seconds = engine.cost.draft_seconds
    assert sorted(seconds) == [1, 2, 4] and all(s > 0 for s in seconds.values())
    assert engine.cost.draft(3) == pytest.approx((seconds[2] + seconds[4]) / 2)
    assert all(engine.backend.allocate() is not None for _ in range(4))  # the engine's own slots untouched
    assert profiling.draft_path(loaded, drafter, 3, 256).is_file()

    def no_measuring(*args, **kwargs):
        raise AssertionError("drafter measured again")

    monkeypatch.setattr(profiling, "measure_draft", no_measuring)
    monkeypatch.setattr(profiling, "_DRAFTS", {})
    again = build_engine(loaded, drafter, scheduler="dspark-async", max_concurrency=4, block_size=3)
    assert again.cost.draft_seconds == seconds  # from the file
    synchronous = build_engine(loaded, drafter, scheduler="dspark", max_concurrency=4, block_size=3)
    assert not synchronous.cost.draft_seconds  # Algorithm 1 runs after drafting: the draft is sunk
    assert build_engine(loaded, drafter, scheduler="fixed", max_concurrency=4, block_size=3).cost is None


def test_int4_and_dense_targets_have_separate_profiles():
    from dspark.quantize import quantize_int4_

    dense = LoadedTarget(tiny_model("llama").to(torch.bfloat16), None, "tiny", None)
    int4 = LoadedTarget(tiny_model("llama").to(torch.bfloat16), None, "tiny", None)
    quantize_int4_(int4.model)
    assert "bfloat16" in profiling.profile_path(dense, 16).name and "int4" in profiling.profile_path(int4, 16).name
    assert "packed" not in profiling.profile_path(int4, 16).name  # int4 layers keep their own kernel


def test_packed_and_plain_bf16_forwards_have_separate_profiles(monkeypatch):
    """Packing the weights (dspark.packed) changes the cost curve, so a profile of the plain forward is not reused."""
    dense = LoadedTarget(tiny_model("llama").to(torch.bfloat16), None, "tiny", None)
    monkeypatch.setattr(profiling, "auto_packed", lambda model: True)
    packed = profiling.profile_path(dense, 16).name
    monkeypatch.setattr(profiling, "auto_packed", lambda model: False)
    assert "bfloat16-packed" in packed and profiling.profile_path(dense, 16).name == packed.replace("-packed", "")


@pytest.mark.parametrize("onednn", [False, True])
def test_compiled_float32_forwards_packed_for_onednn_have_profiles_of_their_own(monkeypatch, onednn):
    """Where compiled float32 products go to oneDNN (`dspark.compiled.onednn_float32`) the compiled forward's and
    the compiled drafter's costs differ from MKL's, so neither profile of the other kind is read."""
    loaded = LoadedTarget(tiny_model("llama"), None, "tiny", None)
    monkeypatch.setattr(profiling, "prefers_onednn_float32", lambda: onednn)
    compiled, eager = profiling.profile_path(loaded, 16, compiled=True).name, profiling.profile_path(loaded, 16).name
    assert ("-compiled2-onednn" in compiled) == onednn and "compiled" not in eager and "onednn" not in eager
    drafter = random_dspark(loaded.model)
    drafter.block = object()  # compiled (only whether it is matters to the tag)
    assert profiling.drafter_tag(drafter).endswith("-compiled-onednn" if onednn else "-compiled")


def test_draft_profile_times_the_model_behind_a_lookup_and_the_commit_it_projects():
    """Each timed proposal follows a decoding round, so the drafter has that round's features to project
    (as in serving, where commits wait for the next draft); the aside requests sample, so a lookup-first
    drafter finds no repeat in them and the model drafts (a greedy loop made the lookup's free drafts the
    measure: 0.2 ms instead of 6 ms for one request of the default drafter)."""
    from dspark.drafters.lookup_first import LookupFirstDrafter

    model = tiny_model("llama", num_layers=3)
    loaded = LoadedTarget(model, None, "tiny", None)
    inner = random_dspark(model)
    drafter = LookupFirstDrafter(inner)
    calls = []
    propose_batch = inner.propose_batch

    def spy(states, *args):
        calls.append(sum(state.num_pending for state in states))
        return propose_batch(states, *args)

    inner.propose_batch = spy
    seconds = profiling.measure_draft(loaded, drafter, max_requests=2, block_size=3, context_tokens=64, repeats=3)
    assert sorted(seconds) == [1, 2] and all(s > 0 for s in seconds.values())
    assert len(calls) == 2 * (1 + 3)  # per request count: the warm-up and every timed proposal ran the model
    timed = [calls[i] for i in (1, 2, 3, 5, 6, 7)]
    assert all(pending > 0 for pending in timed)


def test_compiled_engines_schedule_by_the_compiled_forwards_step_rates(tmp_path, monkeypatch):
    """`--compile` makes a step ~2/3 as costly, which changes how many drafts pay: the dspark scheduler of a
    compiled engine reads rates measured through the compiled forward (with the drafter's feature layers, so the
    profile's compilation is the engine's), cached apart from the eager ones."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(profiling, "_COSTS", {})
    calls = []

    def measured(loaded, max_requests, tokens_per_request, context_tokens=256, repeats=7, compiled=False,
                 layer_ids=()):
        calls.append((compiled, layer_ids))
        rate = 90.0 if compiled else 60.0
        return {1: SPSTable.from_measurements([rate / (1 + 0.1 * b) for b in range(1, tokens_per_request + 1)])}

    monkeypatch.setattr(profiling, "measure_verify", measured)
    model = tiny_model("llama", num_layers=3)
    loaded = LoadedTarget(model, None, "tiny", None)
    drafter = random_dspark(model)
    eager = build_engine(loaded, drafter, scheduler="dspark", block_size=3)
    compiled = build_engine(loaded, drafter, scheduler="dspark", block_size=3, compile=True)
    assert calls == [(False, ()), (True, drafter.target_layer_ids)]
    assert compiled.cost.curve(1)(1) == pytest.approx(1.5 * eager.cost.curve(1)(1))
    compiled_path = profiling.profile_path(loaded, 256, compiled=True)
    assert "-compiled" in compiled_path.name and compiled_path.is_file()
    assert profiling.profile_path(loaded, 256).is_file()
    build_engine(loaded, drafter, scheduler="dspark", block_size=3, compile=True)
    assert len(calls) == 2  # each profile measured once
