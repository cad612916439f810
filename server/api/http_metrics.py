"""`ember:http_requests_total{route, status}`: every HTTP request, counted once its response has started.

`route` is the matched route's path template (`/v1/messages`, `/v1/responses/{response_id}`), never the raw
path, so the label's values stay a fixed, small set; a request no route matched counts as `unmatched`. A
streamed response counts with the status it started with (an in-band error event does not change it).
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HTTPMetricsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            # Routing writes the matched route into this same scope dict (FastAPI's APIRoute sets "route").
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            state = getattr(scope["app"].state, "server", None)  # None before the lifespan built it
            if status and state is not None:
                state.metrics.http_requests.labels(route, str(status)).inc()
