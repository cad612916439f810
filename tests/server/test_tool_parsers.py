"""Tool calls: the three output formats parsed whole and streamed (every split must agree with the whole
parse), parser choice from chat templates and the Hermes prompt fallback (the grammars that force a valid call:
test_tool_grammar.py)."""
from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from server.api.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    ToolParser,
    parser_for_template,
    render_tool_calls,
    render_tool_result,
    template_supports_tools,
    tool_system_prompt,
)
from tool_cases import FLIGHT, NO_PARAMS, WEATHER, Summary, summary


def streamed(parser: ToolParser, pieces: list[str]) -> Summary:
    stream = parser.stream()
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    texts = [e for e in events if isinstance(e, str)]
    assert all(texts), f"empty content delta in {events!r}"
    return "".join(texts) or None, [(c.name, json.loads(c.arguments)) for c in events if isinstance(c, ToolCall)]


# ---------------------------------------------------------------------------------------------- sample outputs

def as_content(text: str) -> tuple[str, Summary]:
    """A sample that holds no call: all of it is content."""
    return text, (text.strip() or None, [])


HERMES_SAMPLES: list[tuple[str, Summary]] = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     (None, [("get_weather", {"city": "Paris", "unit": "celsius"})])),
    ('Let me check both.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2, {"y": "}"}]}}\n</tool_call>',
     ("Let me check both.", [("a", {}), ("b", {"x": [1, 2, {"y": "}"}]})])),
    ('  <tool_call>{"name":"f","arguments":{"q":"</tool_call>"}}</tool_call>  ',
     (None, [("f", {"q": "</tool_call>"})])),
    ('<tool_call> \t\n {"name": "f",\n "arguments": {"a": 1}}  \n\n</tool_call>', (None, [("f", {"a": 1})])),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', (None, [("f", {"a": 1})])),
    ('A <tool_call> B <tool_call>\n{"name": "g", "arguments": {"k": "v"}}\n</tool_call> C',
     ("A <tool_call> B  C", [("g", {"k": "v"})])),
    ('Zürich ✓ <tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>',
     ("Zürich ✓", [("f", {"city": "Zürich"})])),
    as_content('Before <tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call> after'),  # malformed JSON
    as_content('<tool_call>{"name": "f"}</tool_call>'),  # no arguments
    as_content('<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>'),
    as_content('unterminated <tool_call>\n{"name": "f", "arguments": {}}'),
    as_content("x < y and <tool_ca"),
    as_content("Paris is the capital of France."),
    as_content(""),
]

LLAMA3_SAMPLES: list[tuple[str, Summary]] = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', (None, [("get_weather", {"city": "Paris"})])),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
     (None, [("a", {"x": 1}), ("b", {})])),
    ('\n {"name": "a", "parameters": {}};\n{"name": "b", "parameters": {"q": "; {"}};',
     (None, [("a", {}), ("b", {"q": "; {"})])),
    ('{"name": "a", "parameters": {}} and then some text', ("and then some text", [("a", {})])),
    ('{"name": "a", "parameters": {}}; {"oops": 1}', ('; {"oops": 1}', [("a", {})])),
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {',
     ('; {"name": "b", "parameters": {', [("a", {})])),
    as_content('The answer is {"name": "a", "parameters": {}}'),  # calls must open the output
    as_content('{"answer": 42}'),  # JSON that is not a call
    as_content('{"name": "a", "parameters": {'),
    as_content('<|python_tag|>brave_search.call(query="x")'),
    as_content("<|python_ta"),
    as_content("   "),
]

MISTRAL_SAMPLES: list[tuple[str, Summary]] = [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     (None, [("get_weather", {"city": "Paris"})])),
    ('Sure. [TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"l": [1]}}]',
     ("Sure.", [("a", {}), ("b", {"l": [1]})])),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', (None, [("get_weather", {"city": "Paris"})])),
    ('[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b.c-d[ARGS] {"x": "[TOOL_CALLS]"} done',
     ("done", [("a", {}), ("b.c-d", {"x": "[TOOL_CALLS]"})])),
    as_content('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"nom": "b"}]'),  # one bad element spoils the array
    as_content('[TOOL_CALLS][{"name": "a", "arguments": {}'),
    as_content("[TOOL_CALLS] just text"),
    as_content("[TOOL_CALLS]f[ARGS]not json"),
    as_content('[TOOL_CALLS]f[ARG]{"a": 1}'),
    as_content("See [the docs](x) [TOOL"),
]

SAMPLES: dict[str, list[tuple[str, Summary]]] = {
    "hermes": HERMES_SAMPLES, "llama3_json": LLAMA3_SAMPLES, "mistral": MISTRAL_SAMPLES}
ALL_SAMPLES = [(fmt, text, want) for fmt, samples in SAMPLES.items() for text, want in samples]
SAMPLE_IDS = [f"{fmt}-{i}" for i, (fmt, _, _) in enumerate(ALL_SAMPLES)]


@pytest.mark.parametrize(("fmt", "text", "want"), ALL_SAMPLES, ids=SAMPLE_IDS)
def test_parse(fmt: str, text: str, want: Summary) -> None:
    assert summary(PARSERS[fmt]().parse(text)) == want


@pytest.mark.parametrize(("fmt", "text", "want"), ALL_SAMPLES, ids=SAMPLE_IDS)
def test_stream_matches_parse_at_every_split(fmt: str, text: str, want: Summary) -> None:
    parser = PARSERS[fmt]()
    assert streamed(parser, [text]) == want
    assert streamed(parser, list(text)) == want, "one character per delta"
    for k in range(len(text) + 1):
        assert streamed(parser, [text[:k], text[k:]]) == want, f"split at {k}: {text[:k]!r} | {text[k:]!r}"
    for j in range(0, len(text) + 1, 3):  # two split points
        for k in range(j, len(text) + 1, 5):
            assert streamed(parser, [text[:j], text[j:k], text[k:]]) == want, (j, k)
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(parser, pieces) == want, pieces


def test_ids_are_fresh_and_openai_shaped() -> None:
    text = HERMES_SAMPLES[1][0]
    calls = HermesParser().parse(text).tool_calls + HermesParser().parse(text).tool_calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert len({c.id for c in calls}) == 4


def test_stream_emits_content_and_calls_early_and_holds_back_markers() -> None:
    s = HermesParser().stream()
    assert s.feed("Hi, <tool") == ["Hi,"]  # "<tool" might open a call; the space waits for more content
    assert s.feed('_call>\n{"name": "f", "arguments": {}}\n') == []
    out = s.feed("</tool_call> ok")
    assert isinstance(out[0], ToolCall) and out[0].name == "f" and out[1:] == ["  ok"]
    assert s.feed("  ") == [] and s.finish() == []  # trailing whitespace is dropped like parse's strip

    m = MistralParser().stream()
    assert m.feed("a [b] [TOOL_C") == ["a [b]"]
    out = m.feed('ALLS]f[ARGS]{"x": 1}')
    assert [(c.name, c.arguments) for c in out if isinstance(c, ToolCall)] == [("f", '{"x": 1}')]


def test_stream_emits_llama_call_before_the_end() -> None:
    s = Llama3JsonParser().stream()
    assert s.feed('{"name": "a", "parameters": {"x": ') == []
    out = s.feed("1}}; ")
    assert [(c.name, c.arguments) for c in out if isinstance(c, ToolCall)] == [("a", '{"x": 1}')]
    assert s.feed("x") == ["; x"] and s.finish() == []
    t = Llama3JsonParser().stream()
    assert t.feed("The answer") == ["The answer"], "text that cannot open a call streams at once"


def test_garbage_never_raises_and_streams_like_parse() -> None:
    atoms = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[", "]", ";",
             ":", ",", '"', '"name"', '"arguments"', '"parameters"', '"f"', "f", " ", "\n", "x", "\\",
             '{"name": "f", "arguments": {}}', '{"name": "g", "parameters": {"a": [1]}}', "<tool", "[TOOL"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 25)))
        for parser in (HermesParser(), Llama3JsonParser(), MistralParser()):
            want = summary(parser.parse(text))
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 6)))
            assert streamed(parser, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == want, text
    deep = "[" * 50_000
    for parser in (HermesParser(), Llama3JsonParser(), MistralParser()):
        for text in ('<tool_call>{"name": "f", "arguments": ' + deep + "</tool_call>", "{" * 50_000,
                     "[TOOL_CALLS]" + deep):
            assert parser.parse(text).tool_calls == []


# ------------------------------------------------------------------------------------------ chat templates

# Abridged from the public templates: the parts that say how tools are offered and how calls are written.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments " }}
    {{- "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}
    {{- "{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls %}
        {{- '<|im_start|>' + message.role }}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.function.name }}{{- '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

MISTRAL_TEMPLATE = """{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = messages | selectattr("role", "equalto", "user") | list %}
{%- for message in messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and message == user_messages[-1] %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ", " }}{%- endif %}{%- endfor %}
            {{- "][/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {{- tool_call.function | tojson }}{%- if not loop.last %}{{- ", " }}{%- endif %}
        {%- endfor %}
        {{- "]" + eos_token }}
    {%- elif message["role"] == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content|string + "}[/TOOL_RESULTS]" }}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token }}
    {%- endif %}
{%- endfor %}
"""

LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n\\n<|eot_id|>" }}
{%- if tools is not none %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{%- for message in messages %}
    {%- if 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
        {%- else %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + "}" }}
        {%- endif %}
        {{- "<|eom_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
"""

# Llama 3.2-style: the JSON instruction without any <|python_tag|>.
LLAMA32_TEMPLATE = LLAMA31_TEMPLATE.replace('{{- "<|python_tag|>" + tool_call.name + ".call(" }}', "")


def test_parser_for_template_reads_the_format(tok: PreTrainedTokenizerBase) -> None:
    assert "<|python_tag|>" not in LLAMA32_TEMPLATE
    cases = {QWEN_TEMPLATE: "hermes", MISTRAL_TEMPLATE: "mistral", LLAMA31_TEMPLATE: "llama3_json",
             LLAMA32_TEMPLATE: "llama3_json", tok.chat_template: "hermes"}
    for template, want in cases.items():
        assert parser_for_template(template).name == want
    assert parser_for_template(None).name == "hermes"
    assert parser_for_template({"default": tok.chat_template, "tool_use": MISTRAL_TEMPLATE}).name == "mistral"
    assert parser_for_template(QWEN_TEMPLATE, override="mistral").name == "mistral"
    assert isinstance(parser_for_template(None, "llama3_json"), Llama3JsonParser)
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        parser_for_template(QWEN_TEMPLATE, override="qwen")


@pytest.mark.parametrize(("template", "fmt"), [(QWEN_TEMPLATE, "hermes"), (MISTRAL_TEMPLATE, "mistral"),
                                                (LLAMA31_TEMPLATE, "llama3_json")])
def test_templates_write_calls_the_parser_reads(template: str, fmt: str, tok: PreTrainedTokenizerBase) -> None:
    """The templates are real Jinja: the calls they write into a history come back out of the chosen parser."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = tok.apply_chat_template(messages, tools=[{"type": "function", "function": WEATHER}], tokenize=False,
                                   chat_template=template)
    assert WEATHER["description"][:20] in text
    assistant = text.split("Weather?")[-1]
    for marker in ("<|im_end|>", "<|im_start|>assistant", "[/INST]", "<|eot_id|>", "<|eom_id|>", "</s>",
                   "<|start_header_id|>assistant<|end_header_id|>"):
        assistant = assistant.replace(marker, "")
    parser = parser_for_template(template)
    assert parser.name == fmt
    assert summary(parser.parse(assistant)) == (None, [("get_weather", {"city": "Zürich", "days": 2})]), assistant


def test_template_supports_tools(tok: PreTrainedTokenizerBase) -> None:
    assert "tools" not in tok.chat_template and "<|im_start|>" in tok.chat_template  # SmolLM2: plain ChatML
    assert not template_supports_tools(tok.chat_template)
    for template in (QWEN_TEMPLATE, MISTRAL_TEMPLATE, LLAMA31_TEMPLATE):
        assert template_supports_tools(template)
    assert template_supports_tools({"default": tok.chat_template, "tool_use": QWEN_TEMPLATE})
    assert not template_supports_tools({"default": tok.chat_template})
    assert not template_supports_tools("{{- 'I have no tools, sorry' }}{{ messages[0]['content'] }}")
    assert not template_supports_tools(None)


def test_tool_system_prompt_lists_functions_and_fits_smollm2(tok: PreTrainedTokenizerBase) -> None:
    fns = [WEATHER, {"type": "function", "function": FLIGHT}, NO_PARAMS]
    prompt = tool_system_prompt(fns)
    listed = prompt[prompt.index("<tools>\n") + 8:prompt.index("\n</tools>")].split("\n")
    assert [json.loads(line)["function"] for line in listed] == [WEATHER, FLIGHT, NO_PARAMS]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    text = tok.apply_chat_template([{"role": "system", "content": prompt}, {"role": "user", "content": "Hi"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools") and "Zürich" in text  # not \\u-escaped


def test_render_round_trips_through_parse() -> None:
    calls: list[tuple[str, dict[str, Any]]] = [("get_weather", {"city": "Zürich", "unit": "celsius"}),
                                               ("book", {"p": [{"n": "A;B", "x": None}], "q": "</tool_call>"})]
    for fmt, parser in PARSERS.items():
        for some in (calls[:1], calls):
            text = render_tool_calls(fmt, some)
            assert summary(parser().parse(text)) == (None, some), text
    assert render_tool_calls("hermes", calls[:1]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}\n</tool_call>')
    assert render_tool_calls("llama3_json", calls[:1]) == (
        '{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "celsius"}}')
    assert render_tool_calls("mistral", calls[:1]).startswith('[TOOL_CALLS][{"name": "get_weather", "arguments": {')
    assert render_tool_result('{"temp": 21}') == '<tool_response>\n{"temp": 21}\n</tool_response>'
    with pytest.raises(ValueError, match="valid: hermes"):
        render_tool_calls("pythonic", calls)
