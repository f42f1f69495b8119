"""What one request may ask of the server. Every bound has a default and a `dspark serve` flag: a
single client must not be able to hold memory, the event loop or the engine for everyone else."""

import argparse
from dataclasses import dataclass, fields

from dspark.server.protocol import APIError, ChatCompletionRequest, SamplingRequest

RETRY_AFTER_S = 1  #: what a 429 tells a client to wait before trying again


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 2 * 1024 * 1024  #: request body; larger ones get a 413 before they are read
    max_messages: int = 256
    max_stop_strings: int = 16
    max_stop_length: int = 256  #: characters; streamed text is held back by up to this much
    max_prompt_tokens: int | None = None  #: None: the context window less one
    default_max_tokens: int = 512  #: chat requests that set no max_tokens (completions: OpenAI's 16)
    max_tokens: int | None = None  #: the most a client may ask for; None: what the context window leaves
    request_timeout_s: float = 600.0  #: a request's deadline from arrival, queueing included
    drain_timeout_s: float = 30.0  #: on SIGTERM, how long requests in flight may take to finish


def check_request(body: SamplingRequest, limits: ServerLimits) -> None:
    """The operator's bounds on messages and stop strings; a violation names its field."""
    if isinstance(body, ChatCompletionRequest) and len(body.messages) > limits.max_messages:
        raise APIError(400, f"{len(body.messages)} messages; this server accepts at most {limits.max_messages}",
                       param="messages")
    stops = body.stop_strings()
    if len(stops) > limits.max_stop_strings:
        raise APIError(400, f"{len(stops)} stop strings; this server accepts at most {limits.max_stop_strings}",
                       param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_length:
        raise APIError(400, f"a stop string of {longest} characters; this server accepts at most "
                       f"{limits.max_stop_length}", param="stop")


def completion_max_tokens(prompt_tokens: int, requested: int | None, limits: ServerLimits, window: int | None,
                      prompt_param: str) -> int:
    """max_tokens for the engine: the client's (checked against the window and the server's limit)
    or the default, cut to the room the prompt leaves. A prompt that leaves no room is refused as
    such (never as a negative max_tokens)."""
    caps = [c for c in (limits.max_prompt_tokens, None if window is None else window - 1) if c is not None]
    prompt_cap = min(caps, default=None)
    if prompt_cap is not None and prompt_tokens > prompt_cap:
        where = "the context window" if prompt_cap != limits.max_prompt_tokens else "this server"
        raise APIError(400, f"the prompt has {prompt_tokens} tokens; {where} accepts at most {prompt_cap}",
                       param=prompt_param, code="context_length_exceeded")
    room = None if window is None else window - prompt_tokens
    if requested is None:
        return limits.default_max_tokens if room is None else min(limits.default_max_tokens, room)
    if room is not None and requested > room:
        raise APIError(400, f"prompt ({prompt_tokens} tokens) + max_tokens ({requested}) exceeds the context "
                       f"window of {window} tokens", param="max_tokens", code="context_length_exceeded")
    if limits.max_tokens is not None and requested > limits.max_tokens:
        raise APIError(400, f"max_tokens ({requested}) exceeds this server's limit of {limits.max_tokens}",
                       param="max_tokens")
    return requested


# -- command line ------------------------------------------------------------------------------------

FLAG_HELP = {
    "max_body_bytes": "largest request body in bytes (larger: 413)",
    "max_messages": "most chat messages per request",
    "max_stop_strings": "most stop strings per request",
    "max_stop_length": "longest stop string in characters",
    "max_prompt_tokens": "most prompt tokens (default: the context window less one)",
    "default_max_tokens": "max_tokens of chat requests that set none (cut to the context window)",
    "max_tokens": "most tokens a request may ask for (default: what the context window leaves)",
    "request_timeout_s": "per-request deadline in seconds, queueing included (past it: 504)",
    "drain_timeout_s": "on SIGTERM, seconds requests in flight may take before they are ended",
}


def flag_name(field_name: str) -> str:
    return "--" + field_name.removesuffix("_s").replace("_", "-")


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerLimits field (--max-body-bytes, --request-timeout, ...)."""
    for field in fields(ServerLimits):
        seconds = field.name.endswith("_s")
        default = "" if field.default is None else f" (default: {field.default})"
        parser.add_argument(flag_name(field.name), dest=field.name, default=field.default,
                            type=_at_least(0.0, float) if seconds else _at_least(1, int),
                            metavar="SECONDS" if seconds else "N", help=FLAG_HELP[field.name] + default)


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{field.name: getattr(args, field.name) for field in fields(ServerLimits)})


def _at_least(lowest: float, kind: type):
    def parse(text: str):
        value = kind(text)
        if not value >= lowest:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {text}")
        return value

    return parse
