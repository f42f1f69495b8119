"""OpenAI-compatible HTTP API over the engine: /v1/models, /v1/completions, /v1/chat/completions
(plain and server-sent events), /health and Prometheus /metrics."""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.api import TextAccumulator, eos_token_ids, prompt_ids
from dspark.engine import Request as EngineRequest
from dspark.errors import DsparkError
from dspark.loading import LoadedTarget
from dspark.sampling import SamplingParams, make_generator
from dspark.server.metrics import EngineCollector
from dspark.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest
from dspark.server.service import FINISHED, EngineService, QueueFull, ServiceStopped, Submission


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    context_window: int | None = None


def create_app(loaded: LoadedTarget, service: EngineService, config: ServerConfig) -> FastAPI:
    """The FastAPI app; the engine thread starts and drains with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        await asyncio.to_thread(service.stop)

    app = FastAPI(title="dspark", lifespan=lifespan)
    registry = CollectorRegistry()
    registry.register(EngineCollector(service))
    eos = eos_token_ids(loaded)
    _install_error_handlers(app)

    def authorised(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {config.api_key}":
            raise APIError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "in_flight": service.in_flight}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "dspark"}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorised)])
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        _check_model(body, config)
        body.check_supported()
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = prompt_ids(loaded, messages)
        except DsparkError as error:
            raise APIError(400, str(error), param="messages") from None
        except Exception as error:  # the chat template rejected the conversation
            raise APIError(400, f"the chat template cannot render these messages: {error}", param="messages") from None
        return await _serve(http, body, ids, body.token_limit(), "chat.completion")

    @app.post("/v1/completions", dependencies=[Depends(authorised)])
    async def completions(body: CompletionRequest, http: Request):
        _check_model(body, config)
        body.check_supported()
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            vocab = int(loaded.model.get_input_embeddings().weight.shape[0])
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
            ids = torch.tensor(prompt, dtype=torch.long)
        else:
            text = prompt[0] if isinstance(prompt, list) and prompt else prompt
            if not isinstance(text, str) or not text:
                raise APIError(400, "prompt is empty", param="prompt")
            ids = prompt_ids(loaded, text, chat=False)
        if not ids.numel():
            raise APIError(400, "prompt is empty", param="prompt")
        return await _serve(http, body, ids, body.token_limit(), "text_completion")

    async def _serve(http: Request, body: SamplingRequest, ids: torch.Tensor, max_tokens: int | None, kind: str):
        window = config.context_window
        prompt_length = int(ids.shape[0])
        if window is not None:
            if max_tokens is None:
                max_tokens = window - prompt_length
            if max_tokens < 1 or prompt_length + max_tokens > window:
                raise APIError(400, f"prompt ({prompt_length} tokens) + max_tokens ({max_tokens}) exceeds the "
                               f"context window of {window} tokens", param="max_tokens",
                               code="context_length_exceeded")
        elif max_tokens is None:
            max_tokens = 256
        sampling = SamplingParams(body.temperature, max(body.top_k, 0), body.top_p)
        seed = None if body.seed is None else body.seed % (1 << 63)
        request = EngineRequest(ids, max_tokens, sampling, make_generator(seed), eos)
        try:
            submission = service.submit(request)
        except QueueFull as error:
            raise APIError(429, f"server busy: {error}", type="rate_limit_error", code="queue_full") from None
        except ServiceStopped as error:
            raise APIError(503, str(error), type="server_error", code="shutting_down") from None
        reply = Reply(kind, config.model_name, prompt_length)
        text = TextAccumulator(loaded.tokenizer, body.stop_strings())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(service, submission, text, reply, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            parts = [delta async for delta in _deltas(service, submission, text, http)]
        finally:
            service.cancel(submission)
        if http is not None and await http.is_disconnected():
            return Response(status_code=499)
        return reply.whole("".join(parts), _finish_reason(submission, text), len(text.tokens))

    return app


def _check_model(body: SamplingRequest, config: ServerConfig) -> None:
    if body.model is not None and body.model != config.model_name:
        raise APIError(404, f"model {body.model!r} not found; this server serves {config.model_name!r}",
                       param="model", code="model_not_found")


def _finish_reason(submission: Submission, text: TextAccumulator) -> str:
    if text.stopped:
        return "stop"
    return "stop" if submission.request.finish_reason == "stop" else "length"


async def _deltas(service: EngineService, submission: Submission, text: TextAccumulator,
                  http: Request | None = None) -> AsyncIterator[str]:
    """Text deltas of a submission until it finishes, reaches a stop string or the client leaves."""
    while True:
        try:
            item = await asyncio.wait_for(submission.chunks.get(), timeout=1.0)
        except TimeoutError:
            if http is not None and await http.is_disconnected():
                return
            continue
        if item is FINISHED:
            break
        if isinstance(item, Exception):
            raise APIError(500, f"generation failed: {item}", type="server_error")
        delta = text.add(item)
        if delta:
            yield delta
        if text.stopped:
            service.cancel(submission)
            break
    tail = text.flush()
    if tail:
        yield tail


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
        return JSONResponse(error.body(), status_code=error.status)

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
        return JSONResponse(APIError(error.status_code, str(error.detail), type=kind).body(),
                            status_code=error.status_code)

    @app.exception_handler(DsparkError)
    async def dspark_error(request: Request, error: DsparkError) -> JSONResponse:
        return JSONResponse(APIError(400, str(error)).body(), status_code=400)


def build_server(target: str = "default", drafter: str = "default", *, scheduler: str = "dspark",
                 max_concurrency: int = 8, max_queue: int = 64, block_size: int | None = None,
                 api_key: str | None = None, served_model_name: str | None = None,
                 prefill_chunk: int = 512) -> FastAPI:
    """Load the target and drafter, profile if the scheduler needs it, and build the app."""
    from dspark.api import effective_block_size, resolve, scheduler_for
    from dspark.engine import Engine, make_backend

    loaded, drafter_model = resolve(target, drafter)
    if loaded.tokenizer is None:
        raise DsparkError(f"target {loaded.name} has no tokenizer; the server needs one")
    block_size = effective_block_size(drafter_model, block_size)
    scheduler, sps = scheduler_for(scheduler, loaded, drafter_model, block_size, max_concurrency)
    backend = make_backend(loaded.model, drafter_model.target_layer_ids, max_slots=max_concurrency)
    window = getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)
    engine = Engine(backend, drafter_model, block_size=block_size, scheduler=scheduler, sps=sps,
                    prefill_chunk=prefill_chunk, max_context=window)
    config = ServerConfig(served_model_name or loaded.name, api_key, window)
    return create_app(loaded, EngineService(engine, max_queue), config)
