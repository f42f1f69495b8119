"""What stands between the network and the handlers: the API key, the Host header and the body size."""

import hmac

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark.server.protocol import APIError


def key_matches(authorization: str, api_key: str) -> bool:
    """`Authorization: Bearer KEY`, compared in constant time (no timing oracle on the key)."""
    return hmac.compare_digest(authorization.encode("latin-1", "replace"), f"Bearer {api_key}".encode())


def host_name(host_header: str) -> str:
    """The name of a Host header without its port ("[::1]:8000" -> "[::1]"), lower case."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host_header: str, allowed: tuple[str, ...]) -> bool:
    """Exact names, or "*.example.com" for any subdomain; no list allows every host."""
    if not allowed:
        return True
    name = host_name(host_header)
    return any(name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])) for pattern in allowed)


class AllowedHosts:
    """Refuses requests whose Host header is not in the list (DNS rebinding against a local server)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, tuple(a.lower() for a in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not host_allowed(Headers(scope=scope).get("host", ""), self.allowed):
            error = APIError(400, "this Host is not served here", param="host", code="host_not_allowed")
            await JSONResponse(error.body(), status_code=400)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Bodies over `max_bytes` get a 413 in OpenAI's shape: at once when the Content-Length says so
    (before a byte is read), else as soon as the bytes received pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if declared_length(Headers(scope=scope)) > self.max_bytes:
            error = APIError(413, f"request body over this server's limit of {self.max_bytes} bytes",
                             code="body_too_large")
            await JSONResponse(error.body(), status_code=413)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # FastAPI re-raises its HTTPException from body parsing
                raise HTTPException(413, "request body over this server's limit")
            return message

        await self.app(scope, counted, send)


def declared_length(headers: Headers) -> int:
    try:
        return int(headers.get("content-length", "0"))
    except ValueError:
        return 0
