"""OpenAI-compatible HTTP API over the engine: /v1/models, /v1/completions, /v1/chat/completions
(plain and server-sent events), /health and Prometheus /metrics.

A request is validated (protocol.py, limits.py), tokenised off the event loop, and handed to the
engine thread; whatever happens to it there (a failed sampling step, its deadline, a hang-up) ends it
alone, with an error in OpenAI's schema that never quotes torch or Jinja internals.
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import jinja2
import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.drafters import DEFAULT_DRAFTER
from dspark.engine import Engine, GenerationFailed
from dspark.engine import Request as EngineRequest
from dspark.errors import DsparkError
from dspark.factory import build_engine
from dspark.loading import LoadedTarget, TargetSpec, target_dtype_name
from dspark.loading import log as say
from dspark.sampling import make_generator
from dspark.server.guards import AllowedHosts, BodyLimit, key_matches
from dspark.server.limits import RETRY_AFTER_S, ServerLimits, check_request, completion_max_tokens
from dspark.server.metrics import EngineCollector
from dspark.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest
from dspark.server.service import (
    END_OF_STREAM,
    DeadlineExceeded,
    EngineDown,
    EngineService,
    QueueFull,
    ServiceStopped,
    Submission,
)
from dspark.text import TextAccumulator, eos_token_ids, prompt_ids

log = logging.getLogger("dspark.server")


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    context_window: int | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    public_metrics: bool = False  #: serve /metrics without the API key
    allowed_hosts: tuple[str, ...] = ()  #: Host headers served; empty: any


def create_app(loaded: LoadedTarget, service: EngineService, config: ServerConfig) -> FastAPI:
    """The FastAPI app; the engine thread starts and drains with the app's lifespan."""
    limits = config.limits
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="dspark-tokenize")  # one: HF tokenizers are not re-entrant

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        await asyncio.to_thread(service.stop, limits.drain_timeout_s)
        tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dspark", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    if config.allowed_hosts:
        app.add_middleware(AllowedHosts, allowed=config.allowed_hosts)
    app.state.service, app.state.loaded = service, loaded
    registry = CollectorRegistry()
    registry.register(EngineCollector(service))
    eos = eos_token_ids(loaded)
    vocab = int(loaded.model.get_input_embeddings().weight.shape[0])
    _install_error_handlers(app)

    def authorised(request: Request) -> None:
        if config.api_key is not None and not key_matches(request.headers.get("authorization", ""), config.api_key):
            raise APIError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")

    async def off_loop(function: Callable, *args):
        """Tokenising or rendering a long prompt takes seconds: never on the event loop (/health waits)."""
        return await asyncio.get_running_loop().run_in_executor(tokenizing, function, *args)

    @app.get("/health")
    async def health() -> Response:
        if not service.healthy:
            return JSONResponse({"status": "engine_down", "in_flight": service.in_flight}, status_code=503)
        if service.draining:
            return JSONResponse({"status": "draining", "in_flight": service.in_flight}, status_code=503)
        return JSONResponse({"status": "ok", "in_flight": service.in_flight})

    @app.get("/metrics", dependencies=[] if config.public_metrics else [Depends(authorised)])
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "dspark", "dtype": target_dtype_name(loaded.model)}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorised)])
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        _check_body(body, config)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await off_loop(chat_prompt_ids, loaded, messages)
        return await _serve(http, body, ids, body.token_limit(), "chat.completion", "messages")

    @app.post("/v1/completions", dependencies=[Depends(authorised)])
    async def completions(body: CompletionRequest, http: Request):
        _check_body(body, config)
        ids = await off_loop(completion_prompt_ids, loaded, body.prompt, vocab)
        return await _serve(http, body, ids, body.token_limit(), "text_completion", "prompt")

    async def _serve(http: Request, body: SamplingRequest, ids: torch.Tensor, requested: int | None, kind: str,
                     prompt_param: str):
        prompt_length = int(ids.shape[0])
        max_tokens = completion_max_tokens(prompt_length, requested, limits, config.context_window, prompt_param)
        seed = None if body.seed is None else body.seed % (1 << 63)
        sampling = body.sampling_params()
        request = EngineRequest(ids, max_tokens, sampling, make_generator(seed), eos,
                                reproducible=seed is not None and not sampling.greedy)
        submission = _submit(service, request, limits.request_timeout_s)
        reply = Reply(kind, config.model_name, prompt_length)
        text = TextAccumulator(loaded.tokenizer, body.stop_strings())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(service, submission, text, reply, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        whole, hung_up = await _collect(service, submission, text, http)
        if hung_up:
            return Response(status_code=499)  # nobody reads it; the request was aborted at once
        return reply.whole(whole, _finish_reason(submission, text), len(text.tokens))

    return app


def _check_body(body: SamplingRequest, config: ServerConfig) -> None:
    _check_model(body, config)
    body.check_supported()
    check_request(body, config.limits)


def chat_prompt_ids(loaded: LoadedTarget, messages: list[dict[str, str]]) -> torch.Tensor:
    """Prompt ids through the chat template; a template or tokenizer failure is a 400 that quotes only
    what the template itself says (its `raise_exception`), never Jinja's internals."""
    try:
        return prompt_ids(loaded, messages)
    except DsparkError as error:
        raise APIError(400, str(error), param="messages") from None
    except jinja2.TemplateError as error:
        log.info("chat template failed: %r", error)
        if type(error) is jinja2.TemplateError:  # raise_exception("...") in the template: meant for users
            raise APIError(400, f"the chat template refused these messages: {str(error)[:300]}",
                           param="messages") from None
        raise APIError(400, "the chat template cannot render these messages", param="messages") from None
    except Exception:
        log.exception("could not tokenise chat messages")
        raise APIError(400, "these messages could not be tokenised", param="messages") from None


def completion_prompt_ids(loaded: LoadedTarget, prompt: str | list, vocab: int) -> torch.Tensor:
    """Prompt ids of a completion prompt: text, a one-text list, or token ids in [0, vocab)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
        return torch.tensor(prompt, dtype=torch.long)
    text = prompt[0] if isinstance(prompt, list) and prompt else prompt
    if not isinstance(text, str) or not text.strip():
        raise APIError(400, "prompt is empty", param="prompt")
    try:
        ids = prompt_ids(loaded, text, chat=False)
    except Exception:
        log.exception("could not tokenise a prompt")
        raise APIError(400, "the prompt could not be tokenised", param="prompt") from None
    if not ids.numel():
        raise APIError(400, "prompt is empty", param="prompt")
    return ids


def _submit(service: EngineService, request: EngineRequest, timeout_s: float) -> Submission:
    try:
        return service.submit(request, timeout_s)
    except QueueFull as error:
        raise APIError(429, f"server busy: {error}", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except ServiceStopped as error:  # shutting down, or the engine is down
        raise api_error_of(error) from None


def api_error_of(failure: Exception) -> APIError:
    """The client's view of why the engine ended its request (details stay in the server log)."""
    if isinstance(failure, DeadlineExceeded):
        return APIError(504, f"{failure} (--request-timeout)", type="server_error", code="deadline_exceeded")
    if isinstance(failure, EngineDown):
        return APIError(503, str(failure), type="server_error", code="engine_down")
    if isinstance(failure, ServiceStopped):
        return APIError(503, str(failure), type="server_error", code="shutting_down")
    if isinstance(failure, GenerationFailed) and failure.out_of_memory:
        return APIError(503, "the server ran out of memory for this request; retry later or ask for fewer tokens",
                        type="server_error", code="out_of_memory")
    if isinstance(failure, GenerationFailed):
        return APIError(500, f"{failure}; the server log has the details", type="server_error",
                        code="generation_failed")
    if isinstance(failure, DsparkError):
        return APIError(400, str(failure))
    return APIError(500, "generation failed; the server log has the details", type="server_error")


def _check_model(body: SamplingRequest, config: ServerConfig) -> None:
    if body.model is not None and body.model != config.model_name:
        raise APIError(404, f"model {body.model!r} not found; this server serves {config.model_name!r}",
                       param="model", code="model_not_found")


def _finish_reason(submission: Submission, text: TextAccumulator) -> str:
    if text.stopped:
        return "stop"
    return "stop" if submission.request.finish_reason == "stop" else "length"


async def _deltas(service: EngineService, submission: Submission, text: TextAccumulator) -> AsyncIterator[str]:
    """Text deltas of a submission until it finishes or reaches a stop string; a failure of the
    request (in the engine, or turning its tokens into text) raises APIError for it alone."""
    while True:
        item = await submission.chunks.get()
        if item is END_OF_STREAM:
            break
        if isinstance(item, Exception):
            raise api_error_of(item)
        delta = _add_tokens(text, item, submission)
        if delta:
            yield delta
        if text.stopped:
            service.cancel(submission)
            break
    tail = text.flush()
    if tail:
        yield tail


def _add_tokens(text: TextAccumulator, tokens: list[int], submission: Submission) -> str:
    try:
        return text.add(tokens)
    except Exception:
        log.exception("request %s: could not decode its tokens or match its stop strings",
                      submission.request.request_id)
        raise APIError(500, "the generated tokens could not be turned into text; the server log has the details",
                       type="server_error", code="decode_error") from None


async def _collect(service: EngineService, submission: Submission, text: TextAccumulator,
                   http: Request) -> tuple[str, bool]:
    """The whole text of a request, and whether its client hung up first: a hang-up aborts the
    request at once, queued or running, instead of letting it generate for nobody."""
    watcher = asyncio.ensure_future(_until_disconnected(http))
    watcher.add_done_callback(lambda task: _cancel_unless_cancelled(task, service, submission))
    try:
        parts = [delta async for delta in _deltas(service, submission, text)]
        return "".join(parts), watcher.done() and not watcher.cancelled()
    finally:
        watcher.cancel()
        service.cancel(submission)


async def _until_disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)  # a stray body message: keep listening, without spinning


def _cancel_unless_cancelled(task: asyncio.Future, service: EngineService, submission: Submission) -> None:
    if task.cancelled():
        return
    if task.exception() is not None:
        log.debug("disconnect watcher failed: %r", task.exception())
    service.cancel(submission)


async def _sse(service: EngineService, submission: Submission, text: TextAccumulator, reply: "Reply",
               include_usage: bool) -> AsyncIterator[str]:
    try:
        yield _event(reply.chunk(None, first=True))
        try:
            async for delta in _deltas(service, submission, text):
                yield _event(reply.chunk(delta))
        except APIError as error:
            yield _event(error.body())
        else:
            yield _event(reply.chunk(None, finish_reason=_finish_reason(submission, text)))
            if include_usage:
                yield _event(reply.usage_chunk(len(text.tokens)))
        yield "data: [DONE]\n\n"
    finally:  # also on client disconnect (the response task is cancelled): free the slot now
        service.cancel(submission)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Reply:
    """Builds response objects of one request in OpenAI's shapes (chat or text completion)."""

    def __init__(self, kind: str, model: str, prompt_tokens: int) -> None:
        self.kind, self.model, self.prompt_tokens = kind, model, prompt_tokens
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def _envelope(self, object_name: str, choices: list) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, text: str, finish_reason: str, completion_tokens: int) -> dict:
        if self.kind == "chat.completion":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(self.kind, [choice]), "usage": self.usage(completion_tokens)}

    def chunk(self, delta: str | None, first: bool = False, finish_reason: str | None = None) -> dict:
        if self.kind == "chat.completion":
            content = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, completion_tokens: int) -> dict:
        name = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        return {**self._envelope(name, []), "usage": self.usage(completion_tokens)}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            message = "request body is not valid JSON"
        else:
            message = "; ".join(f"{'.'.join(map(str, p.get('loc', ())[1:])) or 'body'}: {p.get('msg')}"
                                for p in problems[:5])
        return JSONResponse(APIError(400, message, param=".".join(location) or None).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = str(error.detail)
        if error.status_code == 400:  # FastAPI could not parse the body: not UTF-8, numbers past 4300 digits, ...
            message = "request body is not valid JSON (or not UTF-8)"
        elif error.status_code == 413:
            return JSONResponse(APIError(413, f"{error.detail} (--max-body-bytes)", code="body_too_large").body(),
                                status_code=413)
        return JSONResponse(APIError(error.status_code, message, type=kind).body(), status_code=error.status_code)

    @app.exception_handler(DsparkError)
    async def dspark_error(request: Request, error: DsparkError) -> JSONResponse:
        return JSONResponse(APIError(400, str(error)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path, exc_info=error)
        body = APIError(500, "internal server error; the server log has the details", type="server_error").body()
        return JSONResponse(body, status_code=500)


def warm_up(engine: Engine) -> None:
    """Compile the target's compiled forward and the drafter's round before listening (minutes on a CPU), not in the
    first requests."""
    backend_warm_up = getattr(engine.backend, "warm_up", None)
    if backend_warm_up is None:
        return
    say("--compile: compiling the decode and verify forwards before listening (about a minute per graph)")
    began = time.monotonic()
    steps = backend_warm_up()
    rounds = engine.drafter.warm_up()
    say(f"--compile: {steps} compiled steps and {rounds} compiled draft rounds ready in "
        f"{time.monotonic() - began:.0f} s")


def build_server(target: TargetSpec = "default", drafter: str = DEFAULT_DRAFTER, *,
                 scheduler: str = "dspark-async",
                 max_concurrency: int = 8, max_queue: int = 64, block_size: int | None = None,
                 api_key: str | None = None, served_model_name: str | None = None,
                 prefill_chunk: int = 512, limits: ServerLimits | None = None, public_metrics: bool = False,
                 allowed_hosts: tuple[str, ...] = (), dtype: str = "auto", draft_gate: bool | None = None,
                 compile: bool = False) -> FastAPI:
    """Load the target (in `dtype`, a `--dtype` name) and drafter, profile if the scheduler needs it, and build
    the app."""
    from dspark.api import resolve

    loaded, drafter_model = resolve(target, drafter, dtype)
    if loaded.tokenizer is None:
        raise DsparkError(f"target {loaded.name} has no tokenizer; the server needs one")
    window = getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)
    engine = build_engine(loaded, drafter_model, scheduler=scheduler, block_size=block_size,
                          max_concurrency=max_concurrency, prefill_chunk=prefill_chunk, max_context=window,
                          draft_gate=draft_gate, compile=compile)
    if compile:
        warm_up(engine)
    config = ServerConfig(served_model_name or loaded.name, api_key, window, limits or ServerLimits(),
                          public_metrics, tuple(allowed_hosts))
    return create_app(loaded, EngineService(engine, max_queue), config)
