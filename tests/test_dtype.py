"""Target dtype: `auto` picks bf16 only where the hardware runs it natively; every command that loads a
target takes `--dtype`, and reports the dtype it ran in."""

import json

import pytest
import torch
from fastapi.testclient import TestClient

from dspark import loading
from dspark.cli import build_parser, main
from dspark.errors import DsparkError
from dspark.loading import cpu_flags, cpu_has_native_bf16, dtype_name, resolve_dtype

ZEN4 = ("processor\t: 0\nmodel name\t: AMD EPYC bf16-free name\n"
        "flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n")
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"
OLD_XEON = "processor\t: 0\nmodel name\t: Intel Xeon (avx512_bf16 capable board)\nflags\t\t: fpu avx2 avx512f\n"


def with_cpuinfo(monkeypatch, text: str) -> None:
    monkeypatch.setattr(loading, "read_cpuinfo", lambda: text)


@pytest.mark.parametrize("cpuinfo, native", [(ZEN4, True), (SAPPHIRE_RAPIDS, True), (OLD_XEON, False), ("", False)])
def test_auto_is_bf16_only_on_cpus_with_native_bf16(monkeypatch, cpuinfo, native):
    with_cpuinfo(monkeypatch, cpuinfo)
    assert cpu_has_native_bf16() is native
    assert resolve_dtype("auto") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", "cpu") == resolve_dtype("auto", torch.device("cpu"))


def test_flags_come_from_the_flags_line_only():
    assert cpu_flags(OLD_XEON) == {"fpu", "avx2", "avx512f"}  # the model name mentions avx512_bf16: ignored
    assert "avx512_bf16" in cpu_flags(ZEN4)


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("float16", torch.float16), (torch.float16, torch.float16)])
def test_explicit_dtypes_ignore_the_cpu(monkeypatch, name, dtype):
    with_cpuinfo(monkeypatch, ZEN4)
    assert resolve_dtype(name) == dtype


def test_auto_on_cuda_follows_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for supported, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda s=supported: s)
        assert resolve_dtype("auto", "cuda") == expected


def test_unknown_dtype_name_is_refused():
    with pytest.raises(DsparkError, match="dtype must be one of auto, float32, bfloat16, float16"):
        resolve_dtype("float8")
    assert dtype_name(torch.bfloat16) == "bfloat16"


COMMANDS = [
    ["generate", "hi"],
    ["serve"],
    ["bench", "speed", "--dataset", "x.jsonl"],
    ["bench", "draft"],
    ["bench", "load"],
    ["bench", "ragged"],
    ["profile"],
    ["eval", "--dataset", "x.jsonl"],
    ["calibrate", "--drafter", "d", "--dataset", "x.jsonl"],
    ["report"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_target_command_takes_dtype(command):
    parser = build_parser()
    assert parser.parse_args(command).dtype == "auto"
    assert parser.parse_args([*command, "--dtype", "bfloat16"]).dtype == "bfloat16"


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_bad_dtype_exits_2(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--dtype", "float8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "--dtype" in err and "float8" in err


def test_bench_draft_keeps_a_separate_drafter_dtype():
    args = build_parser().parse_args(["bench", "draft", "--dtype", "float32", "--draft-dtype", "bfloat16"])
    assert (args.dtype, args.draft_dtype) == ("float32", "bfloat16")


def generate_json(capsys, tiny_on_disk, *extra) -> dict:
    argv = ["generate", "w1 w2 w3", "--target", str(tiny_on_disk / "target"), "--drafter", "none",
            "--max-new-tokens", "4", "--json", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_generate_json_reports_the_dtype(capsys, tiny_on_disk, monkeypatch):
    assert generate_json(capsys, tiny_on_disk)["dtype"] == "float32"  # auto on a CPU without native bf16
    record = generate_json(capsys, tiny_on_disk, "--dtype", "bfloat16")
    assert record["dtype"] == "bfloat16" and len(record["token_ids"]) == 4
    with_cpuinfo(monkeypatch, ZEN4)
    assert generate_json(capsys, tiny_on_disk)["dtype"] == "bfloat16"  # auto, native bf16


def test_models_endpoint_reports_the_dtype(tiny_on_disk, tmp_path, monkeypatch):
    from dspark.server.app import build_server

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    app = build_server(str(tiny_on_disk / "target"), "none", scheduler="fixed", max_concurrency=1,
                       served_model_name="tiny", dtype="bfloat16")
    with TestClient(app) as client:
        models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["dtype"]) for m in models] == [("tiny", "bfloat16")]


def last_json(capsys, *argv) -> dict:
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_profile_and_bench_draft_run_in_the_chosen_dtype(capsys, tiny_on_disk, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    target = tiny_on_disk / "target"
    profile = last_json(capsys, "profile", "--target", target, "--max-concurrency", 2, "--block-size", 1,
                        "--context-tokens", 8, "--dtype", "bfloat16")
    assert profile["dtype"] == "bfloat16" and [len(t) for t in profile["sps_by_requests"]["8"].values()] == [2, 4]
    assert list((tmp_path / "profiles").glob("*-bfloat16-*ctx8-by-requests-v2.json"))  # cached per dtype
    draft = last_json(capsys, "bench", "draft", "--target", target, "--max-layers", 1, "--repeats", 1,
                      "--markov-rank", 4, "--block-size", 2, "--draft-dtype", "float32")
    assert draft["dtype"] == "float32" and draft["draft_dtype"] == "torch.float32"


@pytest.mark.parametrize("cpuinfo, autocast", [(SAPPHIRE_RAPIDS, torch.bfloat16), (OLD_XEON, None)])
def test_training_auto_dtypes_follow_the_cpu(monkeypatch, cpuinfo, autocast):
    """`target_dtype: auto` / `autocast: auto` (the committed configs) train in bf16 only where it is native:
    emulated bf16 made a training step ~18x slower than fp32 on an AVX2-only CPU."""
    from dspark.train.config import TrainConfig
    from dspark.train.trainer import drafter_autocast

    with_cpuinfo(monkeypatch, cpuinfo)
    config = TrainConfig(data="corpus.safetensors", target_dtype="auto", autocast="auto")
    context = drafter_autocast(config, torch.device("cpu"))
    with context:
        product = torch.ones(2, 2) @ torch.ones(2, 2)
    assert product.dtype == (autocast or torch.float32)
    assert isinstance(context, torch.autocast) == (autocast is not None)
    assert isinstance(drafter_autocast(TrainConfig(data="c.safetensors", autocast="bfloat16"), torch.device("cpu")),
                      torch.autocast)  # an explicit dtype is taken as asked
    with pytest.raises(DsparkError, match="target_dtype must be auto or one of"):
        TrainConfig(data="c.safetensors", target_dtype="int4")
    with pytest.raises(DsparkError, match="autocast must be none, auto"):
        TrainConfig(data="c.safetensors", autocast="fp8")


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]], ids=" ".join)
def test_engine_commands_take_the_draft_gate_switch(command):
    """Default None (on for the dspark schedulers), off with --no-draft-gate, forced on with --draft-gate."""
    parser = build_parser()
    assert parser.parse_args(command).draft_gate is None
    assert parser.parse_args([*command, "--no-draft-gate"]).draft_gate is False
    assert parser.parse_args([*command, "--draft-gate"]).draft_gate is True
