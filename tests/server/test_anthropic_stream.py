"""The /v1/messages SSE body from scripted engine outputs (server/api/anthropic_stream.py): block order with text
and tool calls, parallel calls off, stop sequences, a reasoning parser's thinking block first (and thinking blocks
handed back in a request), and an error after the stream started as `event: error`.
The same body on a real server, through the anthropic SDK, is in test_anthropic_api.py."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from engine.client import EngineDeadError
from engine.outputs import RequestOutput
from server.api.anthropic_format import as_chat_request, content_blocks
from server.api.anthropic_stream import MessageSpec, message_events
from server.api.errors import APIError
from server.api.protocol_anthropic import MessagesRequest
from server.api.reasoning import ReasoningParser, Start
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
            stops: list[str] | None = None, reasoning: Start | None = None,
            include: bool = True) -> list[dict[str, Any]]:
    spec = MessageSpec("msg_1", "m", 10, stops, HermesParser() if tools else None, parallel, reasoning, include)

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
    inputs = [json.loads(e["delta"]["partial_json"]) for e in ev
              if e.get("delta", {}).get("type") == "input_json_delta"]
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


THOUGHT = ["Let me th", "ink.\n" + CALL.replace("Paris", "Rome"), "</thi", "nk>\n\n", "Paris.\n", CALL]


def _thinking(ev: list[dict[str, Any]]) -> str:
    return "".join(e["delta"]["thinking"] for e in ev if e.get("delta", {}).get("type") == "thinking_delta")


def test_reasoning_is_a_thinking_block_first_and_calls_come_from_the_answer_only() -> None:
    outs = [_out(t, i + 1, "stop" if i == len(THOUGHT) - 1 else None) for i, t in enumerate(THOUGHT)]
    ev = _events(outs, tools=True, reasoning=Start.REASONING)
    starts = [e for e in ev if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["thinking", "text", "tool_use"]
    assert starts[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    whole = "".join(THOUGHT)
    thought, answer = ReasoningParser(Start.REASONING).split(whole)
    assert _thinking(ev) == thought and "Rome" in thought  # a call inside the reasoning is thought, not a call
    block0 = [e for e in ev if e.get("index") == 0]
    assert [e["type"] for e in block0][-2:] == ["content_block_delta", "content_block_stop"]
    assert block0[-2]["delta"] == {"type": "signature_delta", "signature": ""}
    inputs = [json.loads(e["delta"]["partial_json"]) for e in ev
              if e.get("delta", {}).get("type") == "input_json_delta"]
    assert inputs == [{"city": "Paris"}]
    text = "".join(e["delta"]["text"] for e in ev if e.get("delta", {}).get("type") == "text_delta")
    assert text.rstrip() == "Paris."
    assert [e["index"] for e in ev if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert ev[-2]["delta"]["stop_reason"] == "tool_use"
    assert answer.startswith("Paris.\n")


def test_thinking_disabled_drops_the_block_and_cut_off_reasoning_is_all_thinking() -> None:
    outs = [_out(t, i + 1, "stop" if i == len(THOUGHT) - 1 else None) for i, t in enumerate(THOUGHT)]
    ev = _events(outs, tools=True, reasoning=Start.REASONING, include=False)
    assert [e["content_block"]["type"] for e in ev if e["type"] == "content_block_start"] == ["text", "tool_use"]
    assert [e["index"] for e in ev if e["type"] == "content_block_stop"] == [0, 1]
    cut = _events([_out("<think>hmm </th", 1), _out("x", 2, "length")], reasoning=Start.MAYBE)
    assert [e["content_block"]["type"] for e in cut if e["type"] == "content_block_start"] == ["thinking"]
    assert _thinking(cut) == "hmm </thx"
    assert cut[-2]["delta"]["stop_reason"] == "max_tokens"
    plain = _events([_out("Hi", 1, "stop")], reasoning=Start.MAYBE)  # no think block: no thinking block
    assert [e["content_block"]["type"] for e in plain if e["type"] == "content_block_start"] == ["text"]


def test_content_blocks_put_thinking_first() -> None:
    blocks = [b.model_dump() for b in content_blocks("Paris", [], "hmm")]
    assert blocks == [{"type": "thinking", "thinking": "hmm", "signature": ""}, {"type": "text", "text": "Paris"}]
    assert [b.type for b in content_blocks("Paris", [], "")] == ["text"]


def test_thinking_blocks_handed_back_stay_out_of_the_prompt() -> None:
    body = MessagesRequest.model_validate({"max_tokens": 4, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                          {"type": "redacted_thinking", "data": "x"}, {"type": "text", "text": "Yo"}]},
        {"role": "user", "content": "Again"}], "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert [(m.role, m.content) for m in as_chat_request(body).messages] == [
        ("user", "Hi"), ("assistant", "Yo"), ("user", "Again")]
    bad = MessagesRequest.model_validate({"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "thinking", "thinking": "hmm"}]}]})
    with pytest.raises(APIError, match="thinking blocks belong in assistant turns"):
        as_chat_request(bad)
