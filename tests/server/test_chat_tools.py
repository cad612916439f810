"""How tools reach the prompt (server/api/chat_tools.py): through a template that renders them, or as the Hermes
convention in text for one that does not (SmolLM2's), and which parser and grammar a tool_choice implies."""
from __future__ import annotations

import copy
import json

import pytest

from engine.grammar.compiler import GrammarCompiler
from server.api.chat_tools import plan_tools
from server.api.errors import APIError
from server.api.prompts import render_chat
from server.api.protocol import ChatCompletionRequest

# A Qwen-style template in miniature: it renders `tools` and the history's tool calls itself.
NATIVE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "warm"},
]


@pytest.fixture(scope="module")
def grammars(tok) -> GrammarCompiler:
    return GrammarCompiler(tok, len(tok), (tok.eos_token_id,))


def _body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [TOOL], **fields})


def _text(tok, template: str, plan, add_generation_prompt: bool = True) -> str:
    t = copy.copy(tok)
    t.chat_template = template
    return t.decode(render_chat(t, plan.messages, add_generation_prompt, plan.template_tools))


def test_a_template_with_tool_support_renders_them_itself(tok, grammars) -> None:
    plan = plan_tools(_body(), NATIVE, None, grammars)
    assert plan.parser is not None and plan.parser.name == "hermes" and plan.grammar is None
    assert plan.template_tools == [TOOL["function"]]
    assert plan.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # parsed for the template
    text = _text(tok, NATIVE, plan)
    assert text.startswith("<tools>get_weather;</tools>")
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text


def test_a_template_without_tool_support_gets_the_hermes_convention(tok, grammars) -> None:
    plan = plan_tools(_body(), tok.chat_template, None, grammars)
    assert plan.template_tools is None and plan.parser is not None and plan.parser.name == "hermes"
    system, *rest = plan.messages
    assert system["role"] == "system" and "<tools>" in system["content"] and '"get_weather"' in system["content"]
    assert rest[1] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                       '{"city": "Paris"}}\n</tool_call>'}
    # Both results in one user turn, so the turns still alternate.
    assert rest[2] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n"
                                                  "<tool_response>\nwarm\n</tool_response>"}
    assert len(rest) == 3


def test_tool_choice_decides_parser_and_grammar(tok, grammars) -> None:
    none = plan_tools(_body(tool_choice="none"), tok.chat_template, None, grammars)
    assert none.parser is None and none.grammar is None and "<tools>" not in json.dumps(none.messages)
    forced = plan_tools(_body(tool_choice="required"), tok.chat_template, None, grammars)
    named = plan_tools(_body(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                       tok.chat_template, "mistral", grammars)
    assert forced.grammar is not None and forced.grammar.kind == "lark" and "get_weather" in forced.grammar.source
    assert named.parser is not None and named.parser.name == "mistral" and named.grammar is not None
    grammars.compile(forced.grammar)
    grammars.compile(named.grammar)


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_inconsistent_tool_requests_are_400s(tok, grammars, fields, param) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(_body(**fields), tok.chat_template, None, grammars)
    assert info.value.status == 400 and info.value.param == param


def test_bad_arguments_in_the_history_are_400s(tok, grammars) -> None:
    history = copy.deepcopy(HISTORY)
    history[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(APIError) as info:
        plan_tools(ChatCompletionRequest.model_validate({"messages": history}), tok.chat_template, None, grammars)
    assert info.value.param == "messages"
