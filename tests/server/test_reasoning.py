"""Reasoning in chat (server/api/reasoning.py) on real servers: tiny random models with a DeepSeek-R1-distill
style template (the generation prompt opens the think block) and a Qwen3 style one (the output opens it;
`enable_thinking: false` renders a closed empty block). A random model writes the think block only when forced,
so the outputs go through a guided_regex that spells out `</think>` (such a constraint is applied as written).
The Messages route (anthropic SDK) has no guided_regex: there the R1 template's outputs, cut off by max_tokens, are
all reasoning, and every case is checked against chat's split of the same greedy output."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from server_harness import API_KEY, TINY_CONTEXT, Server, http_client, openai_client, tiny_server
from tiny_models import R1_TEMPLATE

# From Qwen3's: ChatML, and with enable_thinking false an empty think block after the assistant header.
QWEN3_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def _server(make_tiny_model: Any, tmp_path_factory: pytest.TempPathFactory, template: str) -> Iterator[Server]:
    model = make_tiny_model("llama", max_position_embeddings=TINY_CONTEXT, chat_template=template)
    with tiny_server(model, tmp_path_factory.mktemp("logs") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def r1(make_tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _server(make_tiny_model, tmp_path_factory, R1_TEMPLATE)


@pytest.fixture(scope="module")
def qwen3(make_tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _server(make_tiny_model, tmp_path_factory, QWEN3_TEMPLATE)


def _stream(client: openai.OpenAI, **kwargs: Any) -> tuple[str, str, list[str]]:
    """(reasoning, content, every delta's kind in order) of a streamed chat completion."""
    reasoning, content, kinds = "", "", []
    for chunk in client.chat.completions.create(model="tiny-llama", messages=ASK, stream=True, **kwargs):
        for choice in chunk.choices:
            r = getattr(choice.delta, "reasoning_content", None)
            if r:
                reasoning += r
                kinds.append("reasoning")
            if choice.delta.content:
                content += choice.delta.content
                kinds.append("content")
    return reasoning, content, kinds


R1_REGEX = r"step [a-z]{2}\n[a-z]{3}</think>\n\nParis"  # the prompt opened the block: no opening tag


def test_r1_reasoning_split_streamed_and_not(r1: Server) -> None:
    client = openai_client(r1)
    extra = {"guided_regex": R1_REGEX}
    out = client.chat.completions.create(model="tiny-llama", messages=ASK, temperature=0, max_tokens=64,
                                         extra_body=extra)
    message = out.choices[0].message
    reasoning = message.reasoning_content  # type: ignore[attr-defined]
    assert re.fullmatch(r"step [a-z]{2}\n[a-z]{3}", reasoning), reasoning
    assert message.content == "Paris"
    assert out.usage is not None and out.usage.completion_tokens > 3  # reasoning and answer both counted
    streamed, content, kinds = _stream(client, temperature=0, max_tokens=64, extra_body=extra)
    assert (streamed, content) == (reasoning, "Paris")
    assert kinds.index("content") > len(kinds) - 1 - kinds[::-1].index("reasoning")  # all reasoning comes first


def test_include_reasoning_false_drops_it(r1: Server) -> None:
    client = openai_client(r1)
    extra = {"guided_regex": R1_REGEX, "include_reasoning": False}
    out = client.chat.completions.create(model="tiny-llama", messages=ASK, temperature=0, max_tokens=64,
                                         extra_body=extra)
    assert out.choices[0].message.content == "Paris"
    assert getattr(out.choices[0].message, "reasoning_content", None) is None
    assert _stream(client, temperature=0, max_tokens=64, extra_body=extra)[:2] == ("", "Paris")


def test_cut_off_inside_reasoning_has_no_answer(r1: Server) -> None:
    out = openai_client(r1).chat.completions.create(model="tiny-llama", messages=ASK, max_tokens=3,
                                                    extra_body={"guided_regex": R1_REGEX})
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content in (None, "")
    assert out.choices[0].message.reasoning_content  # type: ignore[attr-defined]


def test_structured_output_constrains_the_answer_only(r1: Server) -> None:
    """A JSON schema with a reasoning parser: the output may reason freely first, so it is not JSON from its first
    token; whatever answer comes after </think> is the JSON."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with http_client(r1) as http:
        resp = http.post("/v1/chat/completions", json={
            "model": "tiny-llama", "messages": ASK, "max_tokens": 48, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
        assert resp.status_code == 200, resp.text
        message = resp.json()["choices"][0]["message"]
        assert message["reasoning_content"]  # free text, not held to the schema
        if message["content"]:
            assert isinstance(json.loads(message["content"])["a"], int)


def test_server_info_names_the_parser(r1: Server) -> None:
    with http_client(r1) as http:
        assert http.get("/get_server_info").json()["reasoning_parser"] == "deepseek_r1"


QWEN3_REGEX = r"<think>\n[a-z]{3}\n</think>\n\nParis"


def test_qwen3_output_opens_the_block(qwen3: Server) -> None:
    out = openai_client(qwen3).chat.completions.create(model="tiny-llama", messages=ASK, temperature=0,
                                                       max_tokens=64, extra_body={"guided_regex": QWEN3_REGEX})
    message = out.choices[0].message
    reasoning = message.reasoning_content  # type: ignore[attr-defined]
    assert re.fullmatch(r"\n[a-z]{3}\n", reasoning)
    assert message.content == "Paris"
    streamed = _stream(openai_client(qwen3), temperature=0, max_tokens=64, extra_body={"guided_regex": QWEN3_REGEX})
    assert streamed[:2] == (reasoning, "Paris")


def test_enable_thinking_false_reaches_the_template(qwen3: Server) -> None:
    """chat_template_kwargs renders the closed empty block, so the output is all answer: even a <think> in it."""
    out = openai_client(qwen3).chat.completions.create(
        model="tiny-llama", messages=ASK, temperature=0, max_tokens=64,
        extra_body={"guided_regex": QWEN3_REGEX, "chat_template_kwargs": {"enable_thinking": False}})
    message = out.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content is not None and message.content.startswith("<think>")
    assert out.usage is not None
    on = openai_client(qwen3).chat.completions.create(model="tiny-llama", messages=ASK, max_tokens=1)
    assert out.usage.prompt_tokens > on.usage.prompt_tokens  # type: ignore[union-attr]  # the block is in the prompt


def test_bad_template_kwargs_are_a_400(qwen3: Server) -> None:
    with http_client(qwen3) as http:
        resp = http.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": ASK, "max_tokens": 1,
                                                       "chat_template_kwargs": {"tokenize": True}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template_kwargs"


def test_include_reasoning_false_without_a_parser_is_a_400(server: Server, http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": ASK, "max_tokens": 1,
                                                   "include_reasoning": False})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "include_reasoning"
    assert http.get("/get_server_info").json()["reasoning_parser"] == "none"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# A call written inside the reasoning is thought, not a call: only the answer's call counts.
TOOL_REGEX = (r'maybe <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Rome"\}\}\n</tool_call>'
              r'</think>\n\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>')


def test_tool_calls_are_read_from_the_answer_only(r1: Server) -> None:
    client = openai_client(r1)
    out = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, temperature=0,
                                         max_tokens=400, extra_body={"guided_regex": TOOL_REGEX})
    choice = out.choices[0]
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert "Rome" in choice.message.reasoning_content  # type: ignore[attr-defined]
    assert choice.finish_reason == "tool_calls"
    streamed: list[str] = []
    for chunk in client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, temperature=0,
                                                max_tokens=400, stream=True, extra_body={"guided_regex": TOOL_REGEX}):
        for c in chunk.choices:
            streamed += [t.function.arguments or "" for t in c.delta.tool_calls or [] if t.function]
    assert json.loads("".join(streamed)) == {"city": "Paris"}


def _anthropic(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def _blocks(content: list[Any]) -> list[tuple[str, Any]]:
    """(type, payload) per content block: thinking text (signature checked empty), text, or tool name and input."""
    out: list[tuple[str, Any]] = []
    for b in content:
        if b.type == "thinking":
            assert b.signature == ""
            out.append(("thinking", b.thinking))
        elif b.type == "text":
            out.append(("text", b.text))
        else:
            out.append((b.type, (b.name, b.input)))
    return out


def _chat_blocks(server: Server, max_tokens: int, **kw: Any) -> list[tuple[str, Any]]:
    """Chat's greedy output of the same prompt as the blocks the Messages route should send."""
    message = openai_client(server).chat.completions.create(model="tiny-llama", messages=ASK, temperature=0,
                                                            max_tokens=max_tokens, **kw).choices[0].message
    out: list[tuple[str, Any]] = []
    if getattr(message, "reasoning_content", None):
        out.append(("thinking", message.reasoning_content))  # type: ignore[attr-defined]
    if message.content:
        out.append(("text", message.content))
    out += [("tool_use", (c.function.name, json.loads(c.function.arguments))) for c in message.tool_calls or []]
    return out


def _anthropic_stream(server: Server, **kw: Any) -> tuple[list[tuple[str, Any]], list[str]]:
    """(the streamed message's blocks, the content events as `type` or `type:delta type`) through the SDK."""
    client, kinds = _anthropic(server), []
    with client.messages.stream(model="tiny-llama", messages=ASK, **kw) as stream:  # type: ignore[arg-type]
        for ev in stream:
            if ev.type.startswith("content_block"):
                kinds.append(ev.type + (":" + ev.delta.type if ev.type == "content_block_delta" else ""))
        final = stream.get_final_message()
    return _blocks(final.content), kinds


def _messages(server: Server, max_tokens: int, **kw: Any) -> Any:
    extra = {"temperature": 0, **kw.pop("extra_body", {})}
    return _anthropic(server).messages.create(model="tiny-llama", messages=ASK,  # type: ignore[arg-type]
                                              max_tokens=max_tokens, extra_body=extra, **kw)


def test_messages_thinking_block_is_chats_reasoning(r1: Server) -> None:
    expected = _chat_blocks(r1, 12)
    assert [k for k, _ in expected] == ["thinking"] and expected[0][1]  # cut off inside the reasoning
    out = _messages(r1, 12)
    assert _blocks(out.content) == expected and out.stop_reason == "max_tokens"
    assert out.usage.output_tokens == 12
    streamed, kinds = _anthropic_stream(r1, max_tokens=12, extra_body={"temperature": 0})
    assert streamed == expected
    assert kinds[0] == "content_block_start" and kinds[-2:] == ["content_block_delta:signature_delta",
                                                                 "content_block_stop"]
    assert set(kinds[1:-2]) == {"content_block_delta:thinking_delta"}


def test_messages_thinking_disabled_drops_it(r1: Server) -> None:
    off = {"thinking": {"type": "disabled"}}
    assert _messages(r1, 12, extra_body=off).content == []
    assert _anthropic_stream(r1, max_tokens=12, extra_body={"temperature": 0, **off}) == ([], [])


ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}


def test_messages_forced_tool_use_lets_the_reasoning_run_first(r1: Server) -> None:
    """tool_choice any constrains the answer only, as chat's required does: the same reasoning, no call yet."""
    expected = _chat_blocks(r1, 16, tools=TOOLS, tool_choice="required")
    assert [k for k, _ in expected] == ["thinking"]
    kw: dict[str, Any] = {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "any"}}
    assert _blocks(_messages(r1, 16, **kw).content) == expected
    assert _anthropic_stream(r1, max_tokens=16, extra_body={"temperature": 0}, **kw)[0] == expected


def test_messages_qwen3_blocks_are_chats_split(qwen3: Server) -> None:
    """Whether or not the greedy output opens a think block, the blocks are chat's reasoning and content."""
    expected = _chat_blocks(qwen3, 24)
    assert _blocks(_messages(qwen3, 24).content) == expected
    assert _anthropic_stream(qwen3, max_tokens=24, extra_body={"temperature": 0})[0] == expected
