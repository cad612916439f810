"""Tools in chat completions: what the chat template is given, which parser reads calls out of the output,
and the grammar that forces them (tool_choice "required" or a named function).

A template that renders `tools` itself (Qwen, Llama 3.1, Mistral, Hermes) gets them as the template expects,
and the history's tool calls and results as structured messages. A template without tool support (SmolLM2's
plain ChatML) gets the Hermes convention as text: the tool list in the system prompt, calls written as
`<tool_call>` blocks and results as `<tool_response>` blocks in a user turn, so any model can be offered tools.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.grammar.compiler import GrammarCompiler
from engine.grammar.spec import GrammarSpec
from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, ToolCallIn
from server.api.tool_grammar import MARKERS, special_markers, tool_call_grammar
from server.api.tool_parsers import (
    ToolCall,
    ToolParser,
    parser_for_template,
    render_tool_calls,
    render_tool_result,
    template_supports_tools,
    tool_system_prompt,
)


@dataclass(frozen=True)
class ToolPlan:
    messages: list[dict[str, Any]]  # for apply_chat_template
    template_tools: list[dict[str, Any]] | None  # its `tools` argument (None: not rendered by the template)
    parser: ToolParser | None  # reads tool calls out of the output; None: tool calls are not parsed
    grammar: GrammarSpec | None  # the forced tool-call format (required / named function)
    # The format's markers are special tokens (Llama's <|python_tag|>, Mistral's [TOOL_CALLS]): the output must
    # be detokenized with them, or the parser never sees the calls.
    keep_special_tokens: bool = False


def _text(m: ChatMessage) -> str:
    if isinstance(m.content, str) or m.content is None:
        return m.content or ""
    return "\n".join(p.text for p in m.content)


def _arguments(call: ToolCallIn) -> Any:
    """Arguments as templates expect them: the parsed object (Qwen's and Llama's templates serialize it)."""
    try:
        return json.loads(call.function.arguments)
    except ValueError as exc:
        raise APIError(400, f"tool call {call.function.name!r}: arguments are not valid JSON: {exc}",
                       param="messages") from exc


def _structured(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The history for a template that knows tools: tool calls and results as fields, `developer` as system."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text(m)}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            d["name"] = m.name
        out.append(d)
    return out


def _as_text(messages: Sequence[ChatMessage], parser_name: str) -> list[dict[str, Any]]:
    """The history for a template without tool support: calls and results written out as Hermes-style text,
    consecutive tool results merged into one user turn (so user/assistant turns still alternate)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            block = render_tool_result(_text(m))
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        content = _text(m)
        if m.tool_calls:
            calls = render_tool_calls(parser_name, [(c.function.name, _arguments(c)) for c in m.tool_calls])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    for d in out:
        d.pop("_tool_results", None)
    return out


def _with_tool_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def plan_tools(body: ChatCompletionRequest, chat_template: str | dict[str, str] | None,
               parser_override: str | None, grammars: GrammarCompiler) -> ToolPlan:
    """Raises APIError (400) for a tool_choice that names no given tool, or tool_choice without tools."""
    tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and named not in {t["name"] for t in tools}:
        raise APIError(400, f"tool_choice names function {named!r}, which is not among the tools",
                       param="tool_choice")
    parser = parser_for_template(chat_template, parser_override)
    native = template_supports_tools(chat_template)
    messages = _structured(body.messages) if native else _as_text(body.messages, parser.name)
    if choice == "none":  # as vLLM does by default: the tools are not shown to the model at all
        return ToolPlan(messages, None, None, None)
    if not native:
        messages = _with_tool_prompt(messages, tool_system_prompt(tools))
    markers = special_markers(grammars.tokenizer, MARKERS.get(parser.name, ()))
    grammar = None
    if choice == "required" or named is not None:
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(400, "response_format cannot be combined with a forced tool_choice",
                           param="response_format")
        functions = [t for t in tools if named is None or t["name"] == named]
        parallel = named is None and body.parallel_tool_calls is not False
        # OpenAI's strict is per function and off by default: without it, schema keywords llguidance does not
        # implement are ignored rather than refused.
        lenient = not all(f.get("strict") for f in functions)
        try:
            lark = tool_call_grammar(parser.name, functions, parallel, markers, lenient=lenient)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tools") from exc
        grammar = GrammarSpec("lark", lark, param="tools")
    return ToolPlan(messages, tools if native else None, parser, grammar, keep_special_tokens=bool(markers))


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's reason for an output that ended in tool calls; a cut-off one (length, abort) keeps its own."""
    return "tool_calls" if called and reason == "stop" else reason


def message_parts(parser: ToolParser | None, text: str, parallel: bool) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole output. Without parallel tool calls only the first call is kept."""
    if parser is None:
        return text, []
    parsed = parser.parse(text)
    calls = parsed.tool_calls if parallel else parsed.tool_calls[:1]
    return parsed.content, calls
