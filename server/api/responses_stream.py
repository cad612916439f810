"""The Responses API's output: the response object of a finished turn, and the typed SSE events of a streamed one.

A stream is `response.created`, `response.in_progress`, then per output item `response.output_item.added`, its
content (a reasoning item: `response.content_part.added` with a `reasoning_text` part,
`response.reasoning_text.delta`..., `response.reasoning_text.done`, `response.content_part.done`; a message the
same with `output_text` and `response.output_text.delta` / `.done`; a function call:
`response.function_call_arguments.delta` / `.done`), and
`response.output_item.done`; last `response.completed` (or `response.incomplete`). Every event carries its `type`
and a `sequence_number` that increases by one, and its SSE `event:` line names the type. An error after the 200
has gone out becomes an `error` event followed by `response.failed`. There is no `[DONE]`: OpenAI sends none.
Text that may open a tool call is held back by the tool parser until it is decided, so the deltas joined are
exactly the non-streamed message text.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from server.api.errors import known_error
from server.api.generation import TaggedOutputs
from server.api.protocol_responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)
from server.api.reasoning import ReasoningParser, Start
from server.api.tool_parsers import ToolCall, ToolParser

log = logging.getLogger("ember.server")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Turn:
    """One /v1/responses turn: what its response object echoes, and its token counts once it is done."""

    response_id: str
    model: str
    body: ResponsesRequest
    prompt_tokens: int
    tokenizer: PreTrainedTokenizerBase
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: ResponseStatus, output: list[OutputItem], usage: ResponseUsage | None = None,
                 incomplete: bool = False, error: ResponseError | None = None) -> ResponseObject:
        b = self.body
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, error=error, model=self.model,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
            output=output, usage=usage, instructions=b.instructions, max_output_tokens=b.max_output_tokens,
            previous_response_id=b.previous_response_id, store=b.store, temperature=b.temperature, top_p=b.top_p,
            text=b.text or {"format": {"type": "text"}}, tools=b.tools or [], tool_choice=b.tool_choice or "auto",
            parallel_tool_calls=b.parallel_tool_calls is not False, metadata=b.metadata or {}, reasoning=b.reasoning)

    def finish(self, output: list[OutputItem], output_tokens: int, cached: int, reason: str | None) -> ResponseObject:
        """The finished turn: `incomplete` when the engine stopped it at max_output_tokens."""
        thought = "".join(c.text for item in output if isinstance(item, ReasoningItem) for c in item.content)
        reasoning = len(self.tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
        usage = ResponseUsage(input_tokens=self.prompt_tokens, input_tokens_details=InputTokensDetails(
            cached_tokens=cached), output_tokens=output_tokens, output_tokens_details=OutputTokensDetails(
            reasoning_tokens=min(reasoning, output_tokens)), total_tokens=self.prompt_tokens + output_tokens)
        incomplete = reason == "length"
        return self.response("incomplete" if incomplete else "completed", output, usage, incomplete=incomplete)


def message(text: str) -> MessageItem:
    return MessageItem(id=item_id("msg"), content=[OutputText(text=text)])


def function_call(call: ToolCall) -> FunctionCallItem:
    return FunctionCallItem(id=item_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments)


def reasoning_item(text: str) -> ReasoningItem:
    return ReasoningItem(id=item_id("rs"), content=[ReasoningText(text=text)])


def output_items(thought: str, content: str | None, calls: list[ToolCall]) -> list[OutputItem]:
    """A whole turn's items: its reasoning, its message (also when empty, unless it made calls), its calls."""
    items: list[OutputItem] = [reasoning_item(thought)] if thought else []
    if content or not calls:
        items.append(message(content or ""))
    return items + [function_call(c) for c in calls]


class _Events:
    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence,
                   **{k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in fields.items()}}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def response_events(turn: Turn, outputs: TaggedOutputs, parser: ToolParser | None, parallel: bool,
                          start: Start | None,
                          on_done: Callable[[ResponseObject], None]) -> AsyncGenerator[str, None]:
    ev = _Events()
    items: list[OutputItem] = []
    thought: list[str] = []  # the reasoning item's text so far
    rs_id = ""  # the open reasoning item's id; "": none open
    open_text: list[str] | None = None  # the open message's text so far; None: no message open
    msg_id = ""
    calls = 0

    def begin_message() -> list[str]:
        nonlocal open_text, msg_id
        open_text, msg_id = [], item_id("msg")
        item = MessageItem(id=msg_id, status="in_progress", content=[])
        return [ev("response.output_item.added", output_index=len(items), item=item),
                ev("response.content_part.added", item_id=msg_id, output_index=len(items), content_index=0,
                   part=OutputText(text=""))]

    def end_message() -> list[str]:
        nonlocal open_text
        if open_text is None:
            return []
        text, index = "".join(open_text), len(items)
        done = MessageItem(id=msg_id, content=[OutputText(text=text)])
        items.append(done)
        open_text = None
        return [ev("response.output_text.done", item_id=msg_id, output_index=index, content_index=0, text=text,
                   logprobs=[]),
                ev("response.content_part.done", item_id=msg_id, output_index=index, content_index=0,
                   part=done.content[0]),
                ev("response.output_item.done", output_index=index, item=done)]

    def text_events(text: str) -> list[str]:
        out = begin_message() if open_text is None else []
        assert open_text is not None
        open_text.append(text)
        out.append(ev("response.output_text.delta", item_id=msg_id, output_index=len(items), content_index=0,
                      delta=text, logprobs=[]))
        return out

    def call_events(call: ToolCall) -> list[str]:
        out = end_message()
        item, index = function_call(call), len(items)
        added = item.model_copy(update={"arguments": "", "status": "in_progress"})
        out += [ev("response.output_item.added", output_index=index, item=added),
                ev("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                   delta=call.arguments),
                ev("response.function_call_arguments.done", item_id=item.id, output_index=index,
                   arguments=call.arguments, name=call.name),
                ev("response.output_item.done", output_index=index, item=item)]
        items.append(item)
        return out

    def reasoning_events(text: str) -> list[str]:
        # The reasoning item opens at its first text and streams as one reasoning_text part, as the message does.
        nonlocal rs_id
        out: list[str] = []
        if not rs_id:
            rs_id = item_id("rs")
            out = [ev("response.output_item.added", output_index=len(items),
                      item=ReasoningItem(id=rs_id, status="in_progress")),
                   ev("response.content_part.added", item_id=rs_id, output_index=len(items), content_index=0,
                      part=ReasoningText(text=""))]
        thought.append(text)
        out.append(ev("response.reasoning_text.delta", item_id=rs_id, output_index=len(items), content_index=0,
                      delta=text))
        return out

    def end_reasoning() -> list[str]:
        nonlocal rs_id
        if not rs_id:
            return []
        done, index = ReasoningItem(id=rs_id, content=[ReasoningText(text="".join(thought))]), len(items)
        items.append(done)
        rs_id = ""
        thought.clear()
        return [ev("response.reasoning_text.done", item_id=done.id, output_index=index, content_index=0,
                   text=done.content[0].text),
                ev("response.content_part.done", item_id=done.id, output_index=index, content_index=0,
                   part=done.content[0]),
                ev("response.output_item.done", output_index=index, item=done)]

    base = turn.response("in_progress", [])
    yield ev("response.created", response=base)
    yield ev("response.in_progress", response=base)
    thinker = None if start is None else ReasoningParser(start)
    stream = None if parser is None else parser.stream()
    completion, cached, reason = 0, 0, None
    try:
        async with aclosing(outputs) as outs:
            async for _, out in outs:
                final = out.finish_reason is not None
                completion, cached, reason = out.completion_tokens, out.cached_tokens, out.finish_reason
                text = out.text
                if thinker is not None:
                    r, text = thinker.feed(text, last=final)
                    for e in (reasoning_events(r) if r else []) + (end_reasoning() if text or final else []):
                        yield e
                pieces: list[str | ToolCall] = [text] if stream is None and text else []
                if stream is not None:
                    pieces = (stream.feed(text) if text else []) + (stream.finish() if final else [])
                for piece in pieces:
                    if isinstance(piece, str):
                        for e in text_events(piece):
                            yield e
                    elif parallel or not calls:
                        calls += 1
                        for e in call_events(piece):
                            yield e
        for e in end_reasoning() + end_message():
            yield e
        if not any(isinstance(i, (MessageItem, FunctionCallItem)) for i in items):
            for e in begin_message() + end_message():  # an empty answer is still one (empty) message
                yield e
        done = turn.finish(items, completion, cached, reason)
        on_done(done)
        yield ev("response.incomplete" if done.status == "incomplete" else "response.completed", response=done)
    except Exception as exc:  # the 200 is out: say so in-band, then fail the response
        known = known_error(exc)
        if known is None:
            log.error("error while streaming a response", exc_info=exc)
        message_text = known.message if known is not None else "internal server error while streaming"
        code = (known.code if known is not None else None) or "server_error"
        yield ev("error", code=code, message=message_text, param=known.param if known is not None else None)
        failed = turn.response("failed", items, error=ResponseError(code=code, message=message_text))
        yield ev("response.failed", response=failed)
