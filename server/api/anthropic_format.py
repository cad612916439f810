"""Anthropic Messages onto the chat machinery and back: a MessagesRequest as the ChatCompletionRequest the chat
template, tool planning and sampling code already take, and an output as Anthropic content blocks.

The mapping: `system` becomes the first (system) message; a user turn's `tool_result` blocks become `tool`
messages (in order, text blocks between them a user message), an assistant turn's `tool_use` blocks its
`tool_calls`; tools' `input_schema` is the function's `parameters`; tool_choice auto / any / tool / none is
OpenAI's auto / required / named function / none, so a forced call goes through the same tool grammar.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

from pydantic import ValidationError

from server.api.errors import APIError
from server.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCallIn,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    ToolCallIn,
)
from server.api.protocol_anthropic import (
    ContentBlockOut,
    CountTokensRequest,
    MessageIn,
    MessagesRequest,
    StopReason,
    TextBlock,
    TextOut,
    ThinkingOut,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
)
from server.api.tool_parsers import ToolCall


def _joined(blocks: str | Sequence[TextBlock] | None) -> str:
    if isinstance(blocks, str) or blocks is None:
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def _result_text(block: ToolResultBlock) -> str:
    text = _joined(block.content)
    return f"Error: {text}" if block.is_error else text


def _turn(m: MessageIn) -> list[ChatMessage]:
    if isinstance(m.content, str):
        return [ChatMessage(role=m.role, content=m.content)]
    if m.role == "assistant":
        text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
        calls = [ToolCallIn(id=b.id, function=FunctionCallIn(name=b.name, arguments=json.dumps(b.input)))
                 for b in m.content if isinstance(b, ToolUseBlock)]
        if any(isinstance(b, ToolResultBlock) for b in m.content):
            raise APIError(400, "tool_result blocks belong in user turns", param="messages")
        return [ChatMessage(role="assistant", content=text, tool_calls=calls or None)]
    out: list[ChatMessage] = []
    texts: list[str] = []
    for b in m.content:
        if isinstance(b, ToolUseBlock):
            raise APIError(400, "tool_use blocks belong in assistant turns", param="messages")
        if not isinstance(b, TextBlock | ToolResultBlock):
            raise APIError(400, f"{b.type} blocks belong in assistant turns", param="messages")
        if isinstance(b, TextBlock):
            texts.append(b.text)
            continue
        if texts:
            out.append(ChatMessage(role="user", content="\n".join(texts)))
            texts = []
        out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=_result_text(b)))
    if texts or not out:
        out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def _tool_choice(choice: ToolChoice | None) -> str | NamedToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice of type tool needs a name", param="tool_choice.name")
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def as_chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that renders the same prompt and samples the same way. Raises APIError (400)."""
    messages = [ChatMessage(role="system", content=_joined(body.system))] if body.system else []
    for m in body.messages:
        messages.extend(_turn(m))
    tools = [ChatTool(type="function", function=FunctionDef(name=t.name, description=t.description,
                                                            parameters=t.input_schema))
             for t in body.tools or []] or None
    choice = body.tool_choice
    no_parallel = None if choice is None else choice.disable_parallel_tool_use
    parallel = None if no_parallel is None else not no_parallel
    try:
        req = ChatCompletionRequest(messages=messages, tools=tools, tool_choice=_tool_choice(choice),
                                    parallel_tool_calls=parallel)
    except ValidationError as exc:  # everything was validated on the way in; a last guard against a 500
        raise APIError(400, f"invalid request: {exc.errors()[0].get('msg')}", param="messages") from exc
    if isinstance(body, MessagesRequest):
        req.max_tokens, req.stop, req.stream = body.max_tokens, body.stop_sequences, body.stream
        req.temperature, req.top_p, req.top_k = body.temperature, body.top_p, body.top_k
    return req


def tool_use_id(call: ToolCall) -> str:
    """`toolu_` + the random hex of the parser's `call_` id."""
    return "toolu_" + call.id.removeprefix("call_")


def tool_use_block(call: ToolCall) -> ToolUseOut:
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:  # the parsers hand over JSON objects; a guard, not a path
        args = {}
    return ToolUseOut(id=tool_use_id(call), name=call.name, input=args if isinstance(args, dict) else {})


def content_blocks(text: str | None, calls: Sequence[ToolCall], thinking: str | None = None) -> list[ContentBlockOut]:
    """The thinking block (a reasoning parser's, when it read any), then text, then tool uses."""
    blocks: list[ContentBlockOut] = [ThinkingOut(thinking=thinking)] if thinking else []
    if text:
        blocks.append(TextOut(text=text))
    blocks.extend(tool_use_block(c) for c in calls)
    return blocks


def stop_reason(finish: str | None, stop: str | int | None, stops: Sequence[str] | None,
                called: bool) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of an output that ended with the engine's finish reason and stop reason."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop, str) and stop in (stops or ()):
        return "stop_sequence", stop
    return "end_turn", None  # EOS, a stop token, or an abort (nobody is left to read it)
