"""Request body size limit as a pure ASGI middleware (413 in OpenAI's error shape; Anthropic's on its routes).

A declared Content-Length over the limit is refused before any byte of the body is read. A chunked body is
counted as it arrives and refused once it crosses the limit, so no body larger than the limit is ever held.
(Pure ASGI rather than BaseHTTPMiddleware: the latter wraps `receive` in a way that hides client disconnects.)
"""
from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import anthropic_error_body, error_body, is_anthropic


def _too_large(limit: int) -> str:
    return f"request body exceeds the limit of {limit} bytes (--max-request-bytes)"


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send, scope.get("path", ""))
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised inside FastAPI's body read, which re-raises HTTPException unchanged -> our handler.
                    raise HTTPException(413, _too_large(self.max_bytes))
            return message

        await self.app(scope, limited_receive, send)

    async def _reject(self, send: Send, path: str) -> None:
        message = _too_large(self.max_bytes)
        shaped = anthropic_error_body(413, message) if is_anthropic(path) else error_body(413, message,
                                                                                          code="request_too_large")
        body = json.dumps(shaped).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
