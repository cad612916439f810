"""A Responses request as the chat request it stands for, so /v1/responses runs on chat's machinery: the chat
template, the tool prompt, grammar and parsers (server/api/chat_tools.py) and structured outputs
(server/api/structured.py).

Items map onto chat messages: `message` items keep their role (content as a string or input_text / output_text
parts), `function_call` items become an assistant turn's tool_calls (consecutive ones are one turn, as a model
that called several tools at once wrote them), `function_call_output` items become tool turns, and `reasoning`
items are dropped (the model's earlier reasoning is not part of its next prompt, as chat templates do it).
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest
from server.api.protocol_responses import ResponsesRequest

log = logging.getLogger("ember.server")

_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """This turn's input as a list of items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def _text(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{param}: content must be a string or a list of parts", param=param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{param}[{i}]: content part of type {kind!r} is not supported (Ember serves "
                           "text-only models: input_text and output_text parts)", param=f"{param}[{i}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _field(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{param}.{name} must be a string", param=f"{param}.{name}")
    return value


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (as ChatMessage dicts) of a conversation's items; raises APIError (400) for a bad item."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{param} must be an object", param=param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(400, f"{param}.role must be one of user, system, developer, assistant",
                               param=f"{param}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", param), "type": "function",
                    "function": {"name": _field(item, "name", param), "arguments": _field(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn: text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{param}.output")
            messages.append({"role": "tool", "content": text, "tool_call_id": _field(item, "call_id", param)})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{param}: input items of type {kind!r} are not supported (message, function_call, "
                           "function_call_output and reasoning are)", param=f"{param}.type")
    if not messages:
        raise APIError(400, "input must not be empty", param="input")
    return messages


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Chat tools of the request's function tools. Tool types Ember cannot run (web_search, file_search, mcp,
    local_shell, ...) are left out with one warning: agents such as Codex send them on every request, and the
    model simply never sees them."""
    out, dropped = [], []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            dropped.append(str(kind))
            continue
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        if "name" not in function:
            raise APIError(400, f"tools[{i}].name is required", param=f"tools[{i}].name")
        out.append({"type": "function", "function": function})
    if dropped:
        log.warning("responses request: left out tools Ember cannot run: %s", ", ".join(sorted(set(dropped))))
    return out


def _tool_choice(choice: str | dict[str, Any] | None, have_tools: bool) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        if choice.get("type") in ("auto", "none", "required"):  # the object forms of the string ones
            choice = str(choice["type"])
        else:
            raise APIError(400, f"tool_choice of type {choice.get('type')!r} is not supported: Ember runs "
                           "function tools only", param="tool_choice")
    if not have_tools and choice in ("auto", "none"):
        return None  # every tool was left out (or none given): there is nothing to choose
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format.type")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": schema}


def chat_request(body: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request of a Responses request over the conversation `items` (raises APIError)."""
    tools = function_tools(body.tools)
    choice = _tool_choice(body.tool_choice, bool(tools))
    # A forced call's output is the call, not the answer text.format describes (OpenAI takes both; agents send
    # both on a forced turn): the tool-call grammar constrains that turn, text.format the answering ones.
    forced = choice == "required" or isinstance(choice, dict)
    fields: dict[str, Any] = {
        "messages": chat_messages(body.instructions, items), "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "tools": tools or None, "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": None if forced else
        _response_format(body.text)}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"invalid request: {where}: {first.get('msg')}", code="invalid_value") from None
