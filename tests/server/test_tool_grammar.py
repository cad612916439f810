"""Tool-call grammars (server/api/tool_grammar.py): the llguidance grammars that force a valid call in each output
format, checked token by token with SmolLM2's real tokenizer, and read back by the format's parser."""
from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest
from transformers import PreTrainedTokenizerBase

from server.api.tool_grammar import MARKERS, named_function_grammar, special_markers, tool_call_grammar
from server.api.tool_parsers import PARSERS, MistralParser, render_tool_calls
from tool_cases import FLIGHT, FUNCTIONS, WEATHER, summary


PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
ZURICH = ("get_weather", {"city": "Zürich", "unit": "fahrenheit", "days": 3})
TRIP = ("book_flight", {"route": {"from": "CDG", "to": "JFK"},
                        "passengers": [{"name": "Ada", "age": 36}, {"name": "Bo", "age": 0}], "budget": 799.5})
NOW = ("get_time", {})
ROUTE = {"from": "CDG", "to": "JFK"}
BAD_ARGS: list[tuple[str, Any]] = [
    ("get_weather", {"city": 5, "unit": "celsius"}),  # wrong type
    ("get_weather", {"city": "Paris"}),  # missing required key
    ("get_weather", {"city": "Paris", "unit": "kelvin"}),  # enum outside
    ("get_weather", {"city": "", "unit": "celsius"}),  # minLength
    ("get_weather", {"city": "Paris", "unit": "celsius", "days": 15}),  # above maximum
    ("get_weather", {"city": "Paris", "unit": "celsius", "days": 2.5}),  # not an integer
    ("get_weather", {"city": "Paris", "unit": "celsius", "wind": True}),  # additionalProperties: false
    ("book_flight", {"route": {"from": "CDG"}, "passengers": [{"name": "Ada", "age": 36}]}),  # nested required
    ("book_flight", {"route": {"from": "cdg", "to": "JFK"}, "passengers": [{"name": "Ada", "age": 3}]}),  # $ref pattern
    ("book_flight", {"route": ROUTE, "passengers": []}),  # minItems
    ("book_flight", {"route": ROUTE, "passengers": [{"name": "Ada", "age": 121}]}),  # nested range
    ("book_flight", {"route": ROUTE, "passengers": [{"name": "Ada"}]}),  # nested required
    ("book_flight", {"route": ROUTE, "passengers": [{"name": "Ada", "age": 1}], "budget": 0}),  # exclusiveMinimum
    ("book_flight", {"route": ROUTE, "passengers": [{"name": "Ada", "age": 1}], "class": "first"}),  # enum
    ("get_time", []),  # arguments must be an object
    ("get_weathr", {"city": "Paris", "unit": "celsius"}),  # no such function
]


def run(ll: llguidance.LLTokenizer, grammar: str, ids: list[int]) -> str | None:
    """None if the grammar accepts exactly these tokens, else why not."""
    m = llguidance.LLMatcher(ll, grammar, log_level=0)
    assert not m.is_error(), f"{m.get_error()}\n{grammar}"
    for i, t in enumerate(ids):
        if not m.consume_token(t):
            return f"token {i} rejected"
    return None if m.is_accepting() else "not accepting at the end"


def encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_grammar_accepts_valid_calls_and_parse_reads_them_back(fmt: str, tok: PreTrainedTokenizerBase,
                                                               ll: llguidance.LLTokenizer) -> None:
    single = tool_call_grammar(fmt, FUNCTIONS, parallel=False)
    parallel = tool_call_grammar(fmt, FUNCTIONS, parallel=True)
    for calls in ([PARIS], [ZURICH], [TRIP], [NOW], [TRIP, PARIS], [NOW, ZURICH, PARIS]):
        text = render_tool_calls(fmt, calls)
        assert run(ll, parallel, encode(tok, text)) is None, text
        # With parallel=False a second call is refused.
        assert (run(ll, single, encode(tok, text)) is None) == (len(calls) == 1), text
        assert summary(PARSERS[fmt]().parse(text)) == (None, calls)
    # After a complete call the model may stop: EOS is allowed.
    m = llguidance.LLMatcher(ll, single, log_level=0)
    assert all(m.consume_token(t) for t in encode(tok, render_tool_calls(fmt, [PARIS])))
    assert m.consume_token(tok.eos_token_id) and m.is_stopped()


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_grammar_rejects_wrong_names_and_schema_violations(fmt: str, tok: PreTrainedTokenizerBase,
                                                           ll: llguidance.LLTokenizer) -> None:
    grammar = tool_call_grammar(fmt, FUNCTIONS, parallel=True)
    for bad in BAD_ARGS:
        text = render_tool_calls(fmt, [bad])
        assert run(ll, grammar, encode(tok, text)) is not None, f"accepted {text}"
    good = render_tool_calls(fmt, [PARIS])
    # Fixed separators: no free whitespace, no compact JSON, no text around the call.
    for text in (good.replace('"city": ', '"city":'), good.replace(', "unit"', ',  "unit"'),
                 good.replace("{", "{ ", 2), "Sure! " + good, good + " Done.", good + "\n"):
        assert run(ll, grammar, encode(tok, text)) is not None, f"accepted {text!r}"


def test_hermes_grammar_layout(tok: PreTrainedTokenizerBase, ll: llguidance.LLTokenizer) -> None:
    grammar = tool_call_grammar("hermes", FUNCTIONS, parallel=True)
    one = render_tool_calls("hermes", [PARIS])
    assert run(ll, grammar, encode(tok, one + "\n" + one)) is None
    for text in (one + "\n\n" + one, one + one, one.replace("\n", " "), one.replace("<tool_call>\n", "<tool_call>")):
        assert run(ll, grammar, encode(tok, text)) is not None, repr(text)


def test_mistral_v3_allows_the_sentencepiece_space(tok: PreTrainedTokenizerBase, ll: llguidance.LLTokenizer) -> None:
    grammar = tool_call_grammar("mistral", FUNCTIONS, parallel=False)
    text = render_tool_calls("mistral", [PARIS]).replace("[TOOL_CALLS][", "[TOOL_CALLS] [")
    assert run(ll, grammar, encode(tok, text)) is None
    assert run(ll, grammar, encode(tok, text.replace("] [", "]  ["))) is not None


def test_special_token_markers(tok: PreTrainedTokenizerBase, ll: llguidance.LLTokenizer) -> None:
    """SmolLM2 has no tool tokens, so its <|im_start|> (1) and <|im_end|> (2) stand in for them."""
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert special_markers(ll, ["<|im_start|>", "<tool_call>", "[TOOL_CALLS]", "<|im_end|>"]) == {
        "<|im_start|>": start, "<|im_end|>": end}
    assert special_markers(ll, MARKERS["hermes"]) == {}
    body = json.dumps({"name": PARIS[0], "arguments": PARIS[1]}, ensure_ascii=False)

    hermes = tool_call_grammar("hermes", FUNCTIONS, parallel=False, markers={"<tool_call>": start})
    assert "<[1]>" in hermes
    assert run(ll, hermes, [start] + encode(tok, f"\n{body}\n</tool_call>")) is None
    assert run(ll, hermes, encode(tok, f"<tool_call>\n{body}\n</tool_call>")) is not None, "the text is not the token"

    llama = tool_call_grammar("llama3_json", FUNCTIONS, parallel=False, markers={"<|python_tag|>": start})
    args = render_tool_calls("llama3_json", [PARIS])
    assert run(ll, llama, [start] + encode(tok, args)) is None and run(ll, llama, encode(tok, args)) is None
    assert run(ll, llama, [start, start] + encode(tok, args)) is not None

    # With [ARGS] a special token, mistral takes its newer form: [TOOL_CALLS]name[ARGS]{...}, repeated.
    marks = {"[TOOL_CALLS]": start, "[ARGS]": end}
    mistral = tool_call_grammar("mistral", FUNCTIONS, parallel=True, markers=marks)
    def call(name: str, arguments: dict[str, Any]) -> list[int]:
        return [start] + encode(tok, name) + [end] + encode(tok, json.dumps(arguments, ensure_ascii=False))
    assert run(ll, mistral, call(*ZURICH) + call(*TRIP)) is None
    assert run(ll, mistral, call(*BAD_ARGS[2])) is not None
    assert run(ll, mistral, call("get_weathr", PARIS[1])) is not None
    single = tool_call_grammar("mistral", FUNCTIONS, parallel=False, markers=marks)
    assert run(ll, single, call(*NOW)) is None and run(ll, single, call(*NOW) + call(*NOW)) is not None
    # The text Mistral's tokenizer decodes such calls to.
    text = "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(ZURICH[1], ensure_ascii=False)
    assert summary(MistralParser().parse(text + text.replace("get_weather", "x"))) == (None, [ZURICH, ("x", ZURICH[1])])


def test_named_function_grammar(tok: PreTrainedTokenizerBase, ll: llguidance.LLTokenizer) -> None:
    for fmt in ("hermes", "llama3_json", "mistral"):
        grammar = named_function_grammar(fmt, {"type": "function", "function": FLIGHT})
        assert run(ll, grammar, encode(tok, render_tool_calls(fmt, [TRIP]))) is None
        assert run(ll, grammar, encode(tok, render_tool_calls(fmt, [PARIS]))) is not None


def test_grammar_errors() -> None:
    bad: list[tuple[list[dict[str, Any]], str]] = [
        ([{"name": 5}], "name must be a non-empty string"),
        ([{"description": "no name"}], "name must be a non-empty string"),
        ([{"name": ""}], "name must be a non-empty string"),
        ([{"name": "f", "parameters": ["a"]}], "'f': parameters must be a JSON object"),
        ([{"name": "f", "parameters": '{"type": "object"}'}], "'f': parameters must be a JSON object"),
        ([{"name": "f", "parameters": {"type": "string"}}], "must describe an object"),
        ([], "at least one function"),
    ]
    for functions, message in bad:
        with pytest.raises(ValueError, match=message):
            tool_call_grammar("hermes", functions, parallel=False)
    with pytest.raises(ValueError, match="valid: hermes, llama3_json, mistral"):
        tool_call_grammar("qwen", [WEATHER], parallel=False)
    with pytest.raises(ValueError, match="letters, digits"):
        tool_call_grammar("mistral", [{"name": "get weather"}], parallel=False, markers={"[ARGS]": 7})
    assert tool_call_grammar("mistral", [{"name": "get weather"}], parallel=False)  # v3 takes any name


def test_lenient_ignores_keywords_llguidance_lacks(tok: PreTrainedTokenizerBase, ll: llguidance.LLTokenizer) -> None:
    tags = {"name": "tag", "parameters": {"type": "object", "required": ["t"], "properties": {
        "t": {"type": "array", "items": {"type": "string", "maxLength": 3}, "uniqueItems": True}}}}
    m = llguidance.LLMatcher(ll, tool_call_grammar("hermes", [tags], parallel=False), log_level=0)
    assert m.is_error() and "uniqueItems" in m.get_error()
    grammar = named_function_grammar("hermes", tags, lenient=True)
    assert run(ll, grammar, encode(tok, render_tool_calls("hermes", [("tag", {"t": ["a", "b"]})]))) is None
    assert run(ll, grammar, encode(tok, render_tool_calls("hermes", [("tag", {"t": ["long"]})]))) is not None
