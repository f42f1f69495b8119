"""The OpenAI-compatible server, run by a real uvicorn on a loopback port and driven by the official
`openai` client (and raw HTTP for what a well-behaved client never sends)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from conftest import WORDS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark.api import generate
from dspark.drafters.dspark_drafter import DSparkDrafter
from dspark.ragged import RaggedBackend
from dspark.server.app import build_server

KEY = "sk-test"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThreadedServer:
    """uvicorn serving the app on a background thread."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def tiny_paths(tiny_on_disk, tmp_path_factory):
    os.environ["DSPARK_CACHE"] = str(tmp_path_factory.getbasetemp() / "dspark-cache")  # SPS profile, once a session
    return str(tiny_on_disk / "target"), str(tiny_on_disk / "drafter")


def test_a_compiled_server_compiles_before_it_listens(tiny_paths, monkeypatch, capsys):
    """With --compile the graphs are compiled while the server is built, not inside its first requests."""
    warmed = []  # the target's rounds (counts made up: the message reports what warm_up returned)
    monkeypatch.setattr(RaggedBackend, "warm_up", lambda backend: warmed.append(backend.compiled is not None) or 4)
    drafted = []  # the drafter's compiled round too (a DSpark drafter: three graphs)
    monkeypatch.setattr(DSparkDrafter, "warm_up", lambda drafter: drafted.append(drafter.drafts_compiled) or 3)
    build_server(*tiny_paths, scheduler="fixed", max_concurrency=2)
    assert warmed == [] and drafted == []
    build_server(*tiny_paths, scheduler="fixed", max_concurrency=2, compile=True)
    assert warmed == [True] and drafted == [True]
    assert "4 compiled steps and 3 compiled draft rounds ready" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server(tiny_paths):
    target, drafter = tiny_paths
    app = build_server(target, drafter, max_concurrency=16, max_queue=256, api_key=KEY, served_model_name="tiny")
    with ThreadedServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(client, content: str, **options):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          **{"max_tokens": 12, "temperature": 0, **options})


def streamed_text(stream) -> tuple[str, str | None, dict | None]:
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text += piece or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def metric(server, name: str) -> float:
    lines = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text.splitlines()
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)]
    return sum(values)


# ------------------------------------------------------------------------------- happy paths


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{server.url}/metrics").status_code == 401  # behind the key when one is set
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("dspark_requests_total", "dspark_generation_tokens_total", "dspark_tau", "dspark_acceptance_rate",
                 "dspark_verification_budget", "dspark_queue_depth", "dspark_round_seconds_count"):
        assert name in text


def test_chat_streamed_equals_plain_and_single_request_generation(client, tiny_paths):
    plain = chat(client, "w1 w2 w3", max_tokens=16)
    text, finish, usage = streamed_text(chat(client, "w1 w2 w3", max_tokens=16, stream=True,
                                             stream_options={"include_usage": True}))
    assert text == plain.choices[0].message.content and finish == plain.choices[0].finish_reason
    reference = generate("w1 w2 w3", target=tiny_paths[0], drafter=tiny_paths[1], max_new_tokens=16)
    assert plain.choices[0].message.content == reference.text
    assert plain.usage.completion_tokens == usage.completion_tokens == len(reference.token_ids)
    assert plain.usage.prompt_tokens == usage.prompt_tokens == reference.stats.num_prompt_tokens
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens


def test_completions_streamed_equals_plain(client, tiny_paths):
    plain = client.completions.create(model="tiny", prompt="w4 w5 w6 w7", max_tokens=10, temperature=0)
    text, finish, _ = streamed_text(client.completions.create(model="tiny", prompt="w4 w5 w6 w7", max_tokens=10,
                                                              temperature=0, stream=True))
    assert text == plain.choices[0].text and finish == plain.choices[0].finish_reason
    reference = generate("w4 w5 w6 w7", target=tiny_paths[0], drafter=tiny_paths[1], max_new_tokens=10, chat=False)
    assert plain.choices[0].text == reference.text and plain.usage.completion_tokens == len(reference.token_ids)


def test_stop_strings_cut_text_plain_and_streamed(client):
    full = chat(client, "w9 w8 w7", max_tokens=16, stop=None).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = words[3]
    expected = full[: full.index(stop)]
    plain = chat(client, "w9 w8 w7", max_tokens=16, stop=[stop])
    assert plain.choices[0].message.content == expected and plain.choices[0].finish_reason == "stop"
    text, finish, _ = streamed_text(chat(client, "w9 w8 w7", max_tokens=16, stop=stop, stream=True))
    assert text == expected and finish == "stop"


def test_seeded_sampling_is_reproducible(client):
    first = chat(client, "w3 w2", temperature=1.0, seed=7, max_tokens=10).choices[0].message.content
    again = chat(client, "w3 w2", temperature=1.0, seed=7, max_tokens=10).choices[0].message.content
    assert first == again


# ------------------------------------------------------------------------------- errors


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


def post(server, path: str, body, key: str | None = KEY, timeout: float = 60, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, str | bytes):
        return httpx.post(f"{server.url}{path}", content=body, headers={**headers, "Content-Type": "application/json"},
                          timeout=timeout, **kwargs)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=timeout, **kwargs)


def test_bad_requests_get_openai_errors(server, client):
    assert post(server, "/v1/chat/completions", "{not json").status_code == 400
    assert "JSON" in error_of(post(server, "/v1/chat/completions", "{not json"))["message"]
    messages = [{"role": "user", "content": "w1"}]
    cases = [
        ({"messages": messages, "temperature": 5}, "temperature"),
        ({"messages": messages, "max_tokens": 0}, "max_tokens"),
        ({"messages": [], "max_tokens": 4}, "messages"),
        ({"messages": messages, "n": 2}, "n > 1"),
        ({"messages": [{"role": "wizard", "content": "w1"}]}, "role"),
        ({"messages": messages, "max_tokens": 10**6}, "context window"),
        ({"messages": messages, "logprobs": True}, "logprobs"),
    ]
    for body, needle in cases:
        response = post(server, "/v1/chat/completions", body)
        assert response.status_code == 400, body
        assert needle in error_of(response)["message"], (needle, error_of(response))
    for body in ({"prompt": ""}, {"prompt": ["w1", "w2"]}, {"prompt": [10**9]}, {"prompt": "w1", "echo": True}):
        assert post(server, "/v1/completions", body).status_code == 400, body

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=messages)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=messages, n=3)
    assert post(server, "/v1/chat/completions", {"messages": messages}, key=None).status_code == 401
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{server.url}/v1/nothing-here").status_code == 404


def test_client_disconnect_mid_stream_frees_the_request(server):
    aborted = metric(server, 'dspark_requests_total{finish_reason="abort"}')
    body = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 1500, "temperature": 0.8,
            "seed": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.time() + 30
    while metric(server, 'dspark_requests_total{finish_reason="abort"}') <= aborted:
        assert time.time() < deadline, "the abandoned request was not aborted"
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/health").json()["in_flight"] == 0


def test_full_queue_answers_429(tiny_paths):
    app = build_server(*tiny_paths, max_concurrency=1, max_queue=1, served_model_name="tiny")
    with ThreadedServer(app) as small:
        body = {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 200, "temperature": 0}
        start = threading.Barrier(12)

        def one(_):
            start.wait()
            return post(small, "/v1/chat/completions", body, key=None)

        with ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(one, range(12)))
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) == {200, 429} and statuses.count(200) >= 2, statuses  # one running + one queued
        assert all(error_of(r)["type"] == "rate_limit_error" for r in responses if r.status_code == 429)


# ------------------------------------------------------------------------------- load


def test_bounded_load_no_5xx_and_identical_greedy_outputs(client, tiny_paths):
    prompts = [" ".join(WORDS[i : i + 2 + i % 5]) for i in range(20)]
    expected = {p: generate(p, target=tiny_paths[0], drafter=tiny_paths[1], max_new_tokens=10).text for p in prompts}

    def one(index: int):
        prompt = prompts[index % len(prompts)]
        if index % 3 == 0:
            text, finish, _ = streamed_text(chat(client, prompt, max_tokens=10, stream=True))
        else:
            response = chat(client, prompt, max_tokens=10)
            text, finish = response.choices[0].message.content, response.choices[0].finish_reason
        return prompt, text, finish

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(100)))
    assert len(results) == 100
    for prompt, text, finish in results:
        assert finish in ("stop", "length")
        assert text == expected[prompt], prompt


# ------------------------------------------------------------------------------- fuzzing

SURROGATES = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)  # st.text never draws them
PATHOLOGICAL = (st.sampled_from([10**30, -10**30, 2**31, 2**63, 2**64, -(2**63) - 1, 1e308, -1e308, 1e-40, 5e-324,
                                 -0.0, float("nan"), float("inf"), float("-inf"), "", " ", "\x00", "\ud800",
                                 "w1 \udfff", "\ufffd" * 50, "x" * 20_000, "w1 " * 3000])
                | st.integers(-(10**40), 10**40) | st.floats() | SURROGATES
                | st.text(max_size=3).map(lambda t: t + "\ud83d"))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True) | st.text(max_size=20)
    | PATHOLOGICAL,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8,
)
WORDY = st.text(alphabet="w0123456789 ", max_size=30)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                 "content": st.one_of(WORDY, JSON_VALUES, SURROGATES,
                                                      st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                      "text": WORDY | SURROGATES}),
                                                               max_size=2))})
FIELDS = {
    "model": st.sampled_from(["tiny", "other"]) | JSON_VALUES,
    "max_tokens": st.integers(-2, 8) | JSON_VALUES,
    "max_completion_tokens": st.integers(-2, 8) | PATHOLOGICAL,
    "temperature": st.floats(-1, 3) | st.sampled_from([1e-40, 1e-6, 1e-5, 2.0, 2.0000001]) | JSON_VALUES,
    "top_p": st.floats(-0.5, 1.5) | st.sampled_from([1e-45, 5e-324]) | JSON_VALUES,
    "top_k": st.integers(-3, 100) | JSON_VALUES,
    "stop": st.lists(st.text(max_size=4) | SURROGATES | st.text(min_size=200, max_size=400), max_size=20)
            | JSON_VALUES,
    "seed": st.integers(-2**70, 2**70) | JSON_VALUES,
    "stream": st.booleans() | JSON_VALUES,
    "n": st.integers(0, 3) | PATHOLOGICAL,
    "logprobs": st.booleans() | PATHOLOGICAL,
    "user": JSON_VALUES,
}


def fuzzed_body(data, endpoint: str) -> dict:
    body = {key: data.draw(strategy) for key, strategy in FIELDS.items() if data.draw(st.booleans())}
    if endpoint == "/v1/chat/completions":
        body["messages"] = data.draw(st.lists(MESSAGE, max_size=3) | st.lists(MESSAGE, min_size=250, max_size=300)
                                     | JSON_VALUES)
    else:
        body["prompt"] = data.draw(WORDY | SURROGATES | st.lists(st.integers(-5, 200), max_size=6)
                                   | st.lists(st.integers(3, 90), min_size=2040, max_size=2100) | JSON_VALUES)
    for name in ("max_tokens", "max_completion_tokens"):  # bound the run time, not the validation
        if isinstance(body.get(name), int) and 8 < body[name] < 2**31:
            body[name] = 8
    body.setdefault("max_tokens", 4)
    return body


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_bodies_never_5xx(server, data):
    """Schema fuzzing with large and pathological values (huge and tiny numbers, NaN, lone surrogates,
    long strings, hundreds of messages, prompts past the window, invalid UTF-8): every answer is
    below 500 and in OpenAI's shape."""
    endpoint = data.draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    if data.draw(st.integers(0, 9)) == 0:
        raw = data.draw(st.binary(max_size=300))
    else:
        raw = json.dumps(fuzzed_body(data, endpoint), allow_nan=True)
    response = post(server, endpoint, raw)
    assert response.status_code < 500, (raw[:500], response.text[:500])
    if response.status_code >= 400:
        error_of(response)
    elif response.headers["content-type"].startswith("application/json"):
        assert response.json()["choices"]


# ------------------------------------------------------------------------------- shutdown


def test_sigterm_drains_in_flight_requests(tiny_paths):
    """SIGTERM lets a request that still has its client finish; one whose client hung up was already
    aborted when it left (finding 2: it used to run to its end and hold the shutdown)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "dspark.cli", "serve", "--target", tiny_paths[0], "--drafter", tiny_paths[1],
         "--port", str(port), "--served-model-name", "tiny", "--drain-timeout", "30", "--public-metrics"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.time() + 120
        while True:
            assert process.poll() is None, process.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.2)
        abandoned = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2000, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=abandoned, timeout=0.3)
        aborted = 'dspark_requests_total{finish_reason="abort"} 1.0'
        while aborted not in httpx.get(f"http://127.0.0.1:{port}/metrics").text:
            assert time.time() < deadline, "the abandoned request was not aborted"
            time.sleep(0.05)
        body = {"messages": [{"role": "user", "content": "w2"}], "max_tokens": 300, "temperature": 1.0, "seed": 1,
                "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        finish = json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"]
        assert finish in ("stop", "length")
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
