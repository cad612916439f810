"""Server-sent events: `data: <json>\\n\\n` per chunk, `data: [DONE]` last (OpenAI's framing)."""
from __future__ import annotations

import json
import logging
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.errors import error_body, known_error

log = logging.getLogger("ember.server")

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        # exclude_unset: chunks carry exactly the fields we set (a delta has no "role": null), as vLLM's do.
        return f"data: {payload.model_dump_json(exclude_unset=True)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def error_event(exc: Exception) -> str:
    """An error that happens after the 200 has been sent: OpenAI's error shape as one event."""
    known = known_error(exc)
    if known is not None:
        return event(error_body(known.status, known.message, known.param, known.code))
    log.error("error while streaming", exc_info=exc)
    return event(error_body(500, "internal server error while streaming", code="internal_error"))


class EventStreamResponse(StreamingResponse):
    """A streaming response that always races the stream against the client's disconnect.

    Starlette does that only for ASGI spec < 2.4; from 2.4 on it notices a gone client only when a send
    fails. Racing explicitly cancels the body iterator the moment the disconnect arrives, which closes the
    engine iterator inside it and aborts the request (KV freed within one engine step).
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
