"""Every error leaves the server as OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}`, but
on the Anthropic routes (/v1/messages...), where it is Anthropic's `{"type": "error", "error": {"type", "message"}}`.

Handlers here turn FastAPI's validation errors (422 by default) into 400, unknown routes into 404, engine
validation into 400 with the offending field, a full queue into 503 + Retry-After, and anything unexpected
into a 500 whose body never carries a traceback (the traceback goes to the server log only).
"""
from __future__ import annotations

import http
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.client import EngineDeadError, QueueFullError
from engine.sampling_params import SamplingParamsError

log = logging.getLogger("ember.server")

# status -> OpenAI error type
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


# status -> Anthropic error type (its clients pick their exception class by status, and show the type)
_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


class APIError(Exception):
    """Raised anywhere in a route; rendered by `api_error_handler`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})


class ClientDisconnected(Exception):
    """The client went away before its response was ready; its engine work has been aborted."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: Mapping[str, str] | None = None, path: str = "") -> JSONResponse:
    """`path`: the request's; an Anthropic route gets Anthropic's shape (which has no param or code)."""
    body = anthropic_error_body(status, message) if is_anthropic(path) else error_body(status, message, param, code)
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def unavailable(message: str, retry_after: int) -> APIError:
    return APIError(503, message, code="service_unavailable", headers={"Retry-After": str(retry_after)})


def from_sampling_error(exc: SamplingParamsError) -> APIError:
    code = "context_length_exceeded" if "context length" in str(exc) or "KV pool" in str(exc) else None
    return APIError(400, str(exc), param=exc.param, code=code)


def known_error(exc: Exception) -> APIError | None:
    """The APIError an expected exception stands for (None: unexpected, a 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SamplingParamsError):
        return from_sampling_error(exc)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="service_unavailable")
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine has failed; the server must be restarted", code="engine_dead")
    return None


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers, request.url.path)


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    # loc is ("body", "field", 0, ...): drop the "body" root, keep the path to the offending value.
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return error_response(400, message, param, "invalid_value", path=request.url.path)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404 and exc.detail == "Not Found":
        message = f"route {request.method} {request.url.path} not found"
    elif status == 405:
        message = f"method {request.method} not allowed on {request.url.path}"
    else:
        message = str(exc.detail) if exc.detail else http.HTTPStatus(status).phrase
    return error_response(status, message, headers=exc.headers, path=request.url.path)


async def engine_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """SamplingParamsError -> 400 with its param; QueueFullError / EngineDeadError -> 503 + Retry-After."""
    known = known_error(exc)
    assert known is not None
    if isinstance(exc, EngineDeadError):
        log.error("engine failure while serving %s: %s", request.url.path, exc)
    if known.status == 503:
        known.headers.setdefault("Retry-After", str(request.app.state.settings.retry_after_seconds))
    return await api_error_handler(request, known)


async def disconnected_handler(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody is left to read it


class InternalErrorMiddleware:
    """Unexpected exceptions become OpenAI's 500 here, inside the app.

    Starlette's own handler for `Exception` runs in ServerErrorMiddleware, which re-raises after answering, so
    uvicorn logged a second traceback and closed the connection: a client reusing it got a reset on its next
    request. An exception after the response has started (mid-stream) still propagates: there is no way left
    to answer.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            log.error("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            await error_response(500, "internal server error", code="internal_error",
                                 path=scope.get("path", ""))(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    for engine_error in (SamplingParamsError, QueueFullError, EngineDeadError):
        app.add_exception_handler(engine_error, engine_error_handler)
    app.add_exception_handler(ClientDisconnected, disconnected_handler)
    app.add_middleware(InternalErrorMiddleware)
