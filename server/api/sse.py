"""Server-sent events: `data: <json>\\n\\n` per chunk, `data: [DONE]` last (OpenAI's framing)."""
from __future__ import annotations

import json
import logging
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.api.errors import error_body, known_error

log = logging.getLogger("ember.server")

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        # exclude_unset: chunks carry exactly the fields we set (a delta has no "role": null), as vLLM's do.
        return f"data: {payload.model_dump_json(exclude_unset=True)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def _json(value: str | int | None) -> str:
    # What pydantic writes for these: UTF-8 as is, only quotes, backslashes and control characters escaped.
    # encode_basestring is the C escaper json.dumps(ensure_ascii=False) ends in, minus ~1 us of dispatch.
    if isinstance(value, str):
        return encode_basestring(value)
    return "null" if value is None else str(value)


class ChunkFrame:
    """The per-token events of one stream, rendered without pydantic.

    A streamed token's event is serialized on the event loop while the engine thread waits for the GIL; building
    and dumping a pydantic chunk per token was the largest item there (py-spy, one client). The constant head
    (id, object, created, model) is rendered once; each event adds one choice. The output is byte-identical to
    the pydantic chunk dumped by `event` (tests/test_sse.py); chunks with logprobs, and the once-per-stream
    role and finish chunks of chat, still go through the models.
    """

    def __init__(self, request_id: str, object_name: str, created: int, model: str, include_usage: bool) -> None:
        head = json.dumps({"id": request_id, "object": object_name, "created": created, "model": model},
                          ensure_ascii=False, separators=(",", ":"))
        self._head = f'data: {head[:-1]},"choices":['
        self._tail = '],"usage":null}\n\n' if include_usage else "]}\n\n"

    def completion(self, index: int, text: str, finish_reason: str | None, stop_reason: str | int | None) -> str:
        return (f'{self._head}{{"index":{index},"text":{_json(text)},"logprobs":null,'
                f'"finish_reason":{_json(finish_reason)},"stop_reason":{_json(stop_reason)}}}{self._tail}')

    def chat_content(self, index: int, text: str) -> str:
        return (f'{self._head}{{"index":{index},"delta":{{"content":{_json(text)}}},"logprobs":null,'
                f'"finish_reason":null}}{self._tail}')


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
