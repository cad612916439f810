"""The SSE body of a streaming POST /v1/messages, in the event sequence Anthropic's SDKs parse.

`message_start` (once the prompt is prefilled, so its usage carries the prefix cache's hit), `ping`, then per
content block `content_block_start` / `content_block_delta`s (`text_delta`, or one `input_json_delta` with a
tool call's whole input) / `content_block_stop`, then `message_delta` (stop_reason, usage) and `message_stop`.
With a reasoning parser the model's reasoning comes first, as a thinking block (`thinking_delta`s, then an empty
`signature_delta` before its stop, as Anthropic sends it); tool calls are read from the answer only.
Every event has an `event:` line naming its type. An error after the 200 is an `event: error` in Anthropic's
error shape, and ends the stream.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from server.api.anthropic_format import stop_reason, tool_use_block
from server.api.errors import anthropic_error_body, known_error
from server.api.generation import TaggedOutputs
from server.api.reasoning import ReasoningParser, Start
from server.api.tool_parsers import ToolCall, ToolParser, ToolStream

log = logging.getLogger("ember.server")


def sse(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def error_sse(exc: Exception) -> str:
    known = known_error(exc)
    if known is not None:
        return sse(anthropic_error_body(known.status, known.message))
    log.error("error while streaming /v1/messages", exc_info=exc)
    return sse(anthropic_error_body(500, "internal server error while streaming"))


@dataclass(frozen=True)
class MessageSpec:
    message_id: str
    model: str
    prompt_tokens: int
    stop_sequences: Sequence[str] | None
    parser: ToolParser | None  # reads tool calls out of the text; None: no tools
    parallel: bool  # False: calls after the first are dropped
    reasoning: Start | None = None  # where the output starts, with a reasoning parser; None: no parser
    include_reasoning: bool = True  # False (thinking disabled): the reasoning is dropped


class _Blocks:
    """Content blocks as they open and close. With tools, whitespace-only text is held back until real text
    follows (a model writes newlines between calls; they are no text block of their own)."""

    def __init__(self, hold_whitespace: bool) -> None:
        self.index = -1
        self.open = False  # a text block is open
        self.thinking = False  # the thinking block is open
        self.pending = ""
        self.hold = hold_whitespace

    def thought(self, text: str) -> list[str]:
        out = []
        if not self.thinking:
            self.index, self.thinking = self.index + 1, True
            out.append(sse({"type": "content_block_start", "index": self.index,
                            "content_block": {"type": "thinking", "thinking": "", "signature": ""}}))
        out.append(sse({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": text}}))
        return out

    def _end_thinking(self) -> list[str]:
        if not self.thinking:
            return []
        self.thinking = False
        return [sse({"type": "content_block_delta", "index": self.index,
                     "delta": {"type": "signature_delta", "signature": ""}}),
                sse({"type": "content_block_stop", "index": self.index})]

    def text(self, text: str) -> list[str]:
        if self.open:
            return [sse({"type": "content_block_delta", "index": self.index,
                         "delta": {"type": "text_delta", "text": text}})]
        self.pending += text
        if not (self.pending.strip() if self.hold else self.pending):
            return []
        out = self._end_thinking()
        self.index, self.open = self.index + 1, True
        first, self.pending = self.pending, ""
        start = {"type": "content_block_start", "index": self.index, "content_block": {"type": "text", "text": ""}}
        return [*out, sse(start), *self.text(first)]

    def close(self) -> list[str]:
        self.pending = ""
        out = self._end_thinking()
        if not self.open:
            return out
        self.open = False
        return [*out, sse({"type": "content_block_stop", "index": self.index})]

    def tool_use(self, call: ToolCall) -> list[str]:
        out = self.close()
        self.index += 1
        block = tool_use_block(call)
        out.append(sse({"type": "content_block_start", "index": self.index,
                        "content_block": {"type": "tool_use", "id": block.id, "name": block.name, "input": {}}}))
        out.append(sse({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block.input)}}))
        out.append(sse({"type": "content_block_stop", "index": self.index}))
        return out


async def message_events(spec: MessageSpec, outputs: TaggedOutputs) -> AsyncGenerator[str, None]:
    blocks = _Blocks(hold_whitespace=spec.parser is not None)
    stream: ToolStream | None = spec.parser.stream() if spec.parser is not None else None
    thinker = ReasoningParser(spec.reasoning) if spec.reasoning is not None else None
    calls = 0
    started = False
    try:
        async with aclosing(outputs) as outs:  # closing the stream closes (aborts) the engine request
            async for _, out in outs:
                if not started:
                    started = True
                    usage = {"input_tokens": spec.prompt_tokens - out.cached_tokens, "output_tokens": 0,
                             "cache_read_input_tokens": out.cached_tokens, "cache_creation_input_tokens": 0}
                    yield sse({"type": "message_start", "message": {
                        "id": spec.message_id, "type": "message", "role": "assistant", "model": spec.model,
                        "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})
                    yield sse({"type": "ping"})
                final = out.finish_reason is not None
                text = out.text
                if thinker is not None:
                    thought, text = thinker.feed(text, last=final)
                    if thought and spec.include_reasoning:
                        for e in blocks.thought(thought):
                            yield e
                events: list[str | ToolCall] = [text] if text else []
                if stream is not None:
                    events = (stream.feed(text) if text else []) + (stream.finish() if final else [])
                for ev in events:
                    if isinstance(ev, str):
                        for e in blocks.text(ev):
                            yield e
                    elif spec.parallel or not calls:
                        calls += 1
                        for e in blocks.tool_use(ev):
                            yield e
                if final:
                    for e in blocks.close():
                        yield e
                    reason, sequence = stop_reason(out.finish_reason, out.stop_reason, spec.stop_sequences,
                                                   calls > 0)
                    yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                               "usage": {"output_tokens": out.completion_tokens}})
                    yield sse({"type": "message_stop"})
    except Exception as exc:  # the 200 is out: all we can do is tell the client in-band
        yield error_sse(exc)
