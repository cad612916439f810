"""The /v1/messages SSE body from scripted engine outputs (server/api/anthropic_stream.py): block order with text
and tool calls, parallel calls off, stop sequences, and an error after the stream started as `event: error`.
The same body on a real server, through the anthropic SDK, is in test_anthropic_api.py."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from engine.client import EngineDeadError
from engine.outputs import RequestOutput
from server.api.anthropic_stream import MessageSpec, message_events
from server.api.tool_parsers import HermesParser

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _out(text: str, done: int, finish: str | None = None, stop: str | int | None = None) -> RequestOutput:
    return RequestOutput("msg_1", 0, (1,), text, None, finish, 10, done, stop, cached_tokens=4)  # type: ignore[arg-type]


async def _outputs(outs: list[RequestOutput], fail: bool) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    for o in outs:
        yield 0, o
    if fail:
        raise EngineDeadError("the engine thread died")


def _events(outs: list[RequestOutput], tools: bool = False, parallel: bool = True, fail: bool = False,
            stops: list[str] | None = None) -> list[dict[str, Any]]:
    spec = MessageSpec("msg_1", "m", 10, stops, HermesParser() if tools else None, parallel)

    async def run() -> list[str]:
        return [e async for e in message_events(spec, _outputs(outs, fail))]

    parsed = []
    for frame in asyncio.run(run()):
        name, data = frame.rstrip("\n").split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert name == f"event: {body['type']}"
        parsed.append(body)
    return parsed


def test_message_start_has_the_cache_hit_and_text_streams_as_one_block() -> None:
    ev = _events([_out("Hel", 1), _out("lo", 2, "stop", 2)])
    assert [e["type"] for e in ev] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                       "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert ev[0]["message"]["usage"] == {"input_tokens": 6, "output_tokens": 0, "cache_read_input_tokens": 4,
                                         "cache_creation_input_tokens": 0}
    assert "".join(e["delta"]["text"] for e in ev if e["type"] == "content_block_delta") == "Hello"
    assert ev[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert ev[-2]["usage"] == {"output_tokens": 2}


def test_stop_sequence_and_max_tokens() -> None:
    assert _events([_out("a", 1, "stop", "END")], stops=["END"])[-2]["delta"] == {
        "stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert _events([_out("a", 1, "length")])[-2]["delta"]["stop_reason"] == "max_tokens"


def test_text_then_tool_calls_are_separate_blocks_and_parallel_off_keeps_one() -> None:
    outs = [_out("Let me look.\n", 1), _out(CALL + "\n", 2), _out(CALL, 3, "stop", 2)]
    ev = _events(outs, tools=True)
    starts = [e["content_block"] for e in ev if e["type"] == "content_block_start"]
    assert [s["type"] for s in starts] == ["text", "tool_use", "tool_use"]  # no block for the newline between
    assert all(s["id"].startswith("toolu_") and s["input"] == {} for s in starts[1:])
    inputs = [json.loads(e["delta"]["partial_json"]) for e in ev if e.get("delta", {}).get("type") == "input_json_delta"]
    assert inputs == [{"city": "Paris"}] * 2
    assert [e["index"] for e in ev if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert ev[-2]["delta"]["stop_reason"] == "tool_use"
    single = _events(outs, tools=True, parallel=False)
    assert [e["content_block"]["type"] for e in single if e["type"] == "content_block_start"] == ["text", "tool_use"]


def test_an_error_after_the_start_is_an_error_event() -> None:
    ev = _events([_out("Hel", 1)], fail=True)
    assert [e["type"] for e in ev][:3] == ["message_start", "ping", "content_block_start"]
    assert ev[-1] == {"type": "error", "error": {"type": "overloaded_error",
                                                 "message": "the engine has failed; the server must be restarted"}}
