"""API key check (`--api-key` / EMBER_API_KEY) for every route but the probes /health, /metrics and /v1/loads
(which carries the numbers /metrics already shows, for routers that poll it).

Accepts `Authorization: Bearer KEY` (what OpenAI clients send) or `x-api-key: KEY`. Compared with
`secrets.compare_digest` so the time taken does not reveal how much of a guessed key was right.
"""
from __future__ import annotations

import secrets

from fastapi import Request

from server.api.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics", "/v1/loads"})


def _presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    return request.headers.get("x-api-key")


async def require_api_key(request: Request) -> None:
    """App-wide dependency; a no-op when no key is configured."""
    expected: str | None = request.app.state.settings.api_key
    if expected is None or request.url.path in OPEN_PATHS:
        return
    presented = _presented_key(request)
    if presented is None:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                       code="invalid_api_key")
    if not secrets.compare_digest(presented.encode(), expected.encode()):
        raise APIError(401, "invalid API key", code="invalid_api_key")
