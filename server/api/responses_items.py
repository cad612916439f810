"""GET /v1/responses/{id}/input_items: a stored response's input items, in OpenAI's list shape.

The items listed are the conversation the response was generated from, as its record keeps it
(server/api/responses_store.py): every earlier turn's input and output items of a `previous_response_id` chain,
then the turn's own input. Each item gets an `id` when it is stored (one the client gave is kept, and an earlier
turn's output items keep their output ids), so `after` pages by ids that do not change between calls.
"""
from __future__ import annotations

import uuid
from typing import Any, Literal

from server.api.errors import APIError
from server.api.protocol_responses import InputItemList

_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _kind(item: dict[str, Any]) -> str | None:
    # An item with a role and no type is a message (responses_input.chat_messages reads it the same way).
    return item.get("type", "message" if "role" in item else None)


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items, each with a string `id`: a client's own is kept, others are given one."""
    return [item if isinstance(item.get("id"), str) else
            {**item, "id": f"{_PREFIX.get(str(_kind(item)), 'item')}_{uuid.uuid4().hex}"} for item in items]


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    """A stored item in the shape the SDK's ResponseItem parses: a message's string content becomes one text part
    (input_text, or output_text with annotations for the assistant's), every item has a type and a status."""
    kind = _kind(item)
    out = {**item, "type": kind, "status": item.get("status") or "completed"}
    if kind == "message":
        assistant = item.get("role") == "assistant"
        content = item.get("content")
        parts = [{"type": "output_text" if assistant else "input_text", "text": content or ""}] \
            if content is None or isinstance(content, str) else [dict(p) for p in content]
        for part in parts:
            if assistant and part.get("type") == "output_text":
                part.setdefault("annotations", [])
        out["content"] = parts
    return out


def page(items: list[dict[str, Any]], limit: int, order: Literal["asc", "desc"], after: str | None) -> InputItemList:
    """One page of `items` (oldest first as stored): `limit` of them in `order`, starting after the id `after`."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise APIError(400, f"after: no input item with id '{after}' in this response", param="after",
                           code="invalid_value")
        ordered = ordered[ids.index(after) + 1:]
    data = [_listed(item) for item in ordered[:limit]]
    return InputItemList(data=data, first_id=data[0]["id"] if data else None,
                         last_id=data[-1]["id"] if data else None, has_more=len(ordered) > limit)
