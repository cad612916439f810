"""Lark grammars for llguidance that accept exactly the tool calls a request allows (`tool_choice` "required"
or a named function), written in the model's own format so `tool_parsers` reads them back.

The envelope (markers, `{"name": "f", "arguments": `) is fixed text; each function's arguments are a `%json`
block rooted at its `parameters` schema, so `$ref`s into its `$defs` resolve as the client wrote them.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import llguidance

from engine.grammar.compiler import JSON_OPTIONS, lark_string
from server.api.tool_parsers import HermesParser, Llama3JsonParser, MistralParser

# JSON_OPTIONS: the structured-output JSON form (fixed separators, no free whitespace; see the compiler), which
# render_tool_calls writes too. llguidance reads "x-guidance" only at the top of a schema, so each %json block
# carries it.

# The markers of each format that a tokenizer may hold as single special tokens (see special_markers).
MARKERS: dict[str, tuple[str, ...]] = {
    HermesParser.name: (HermesParser.OPEN, HermesParser.CLOSE),
    Llama3JsonParser.name: (Llama3JsonParser.TAG,),
    MistralParser.name: (MistralParser.OPEN, MistralParser.ARGS),
}


def special_markers(tokenizer: llguidance.LLTokenizer, markers: Iterable[str]) -> dict[str, int]:
    """The markers the tokenizer holds as one special token, with their ids. A special token never matches
    literal text in llguidance, so the grammar must name it by id; a marker that is plain text (or an added
    token not flagged special, as Qwen's <tool_call>) stays a string literal."""
    out: dict[str, int] = {}
    for marker in markers:
        ids = tokenizer.tokenize_str(marker, parse_special=True)
        if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
            out[marker] = ids[0]
    return out


def _envelope(name: str, key: str) -> str:
    """The fixed text before a call's arguments: `{"name": "<name>", "<key>": `, as json.dumps writes it."""
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ", " + json.dumps(key) + ": "


def _checked(fn: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, arguments schema) of an OpenAI function object (or a {"type": "function", "function": ...} tool)."""
    if isinstance(fn, dict) and isinstance(fn.get("function"), dict):
        fn = fn["function"]
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"a function's name must be a non-empty string, got {name!r}")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object"}
    if not isinstance(params, dict):
        raise ValueError(f"function {name!r}: parameters must be a JSON object (a JSON schema), "
                         f"got {type(params).__name__}")
    if isinstance(params.get("type"), str) and params["type"] != "object":
        raise ValueError(f"function {name!r}: parameters must describe an object, not {params['type']!r}")
    return name, params


def tool_call_grammar(parser_name: str, functions: list[dict[str, Any]], parallel: bool,
                      markers: dict[str, int] | None = None, *, lenient: bool = False) -> str:
    """A grammar accepting one call (one or more when `parallel`) of one of `functions`, in the format of
    `parser_name`, with arguments valid for that function's parameters schema. `markers` maps a marker to its
    token id where the tokenizer has it as one special token (special_markers finds them). llguidance refuses
    schemas with keywords it does not implement (`uniqueItems`, `not`, ...): the matcher is then in an error
    state; `lenient` makes it ignore them instead (the arguments are then checked against the rest).

    Mistral has two forms: `[TOOL_CALLS][{...}, ...]` (v3) and `[TOOL_CALLS]name[ARGS]{...}` (v11 tokenizers,
    e.g. Mistral Small 3.2). The second is taken when `[ARGS]` is a special token, which only tokenizers made
    for that form name; the v3 form otherwise."""
    if parser_name not in MARKERS:
        raise ValueError(f"unknown tool-call parser {parser_name!r}; valid: {', '.join(sorted(MARKERS))}")
    checked = [_checked(fn) for fn in functions]
    if not checked:
        raise ValueError("tool_call_grammar needs at least one function")
    ids = markers or {}

    def mark(text: str) -> str:  # special tokens are referred to by id: `<[id]>`
        return f"<[{ids[text]}]>" if text in ids else lark_string(text)

    rules: list[str] = []
    options = {**JSON_OPTIONS, "lenient": True} if lenient else JSON_OPTIONS
    args = [f"args{i}: %json {json.dumps({**params, 'x-guidance': options})}" for i, (_, params) in enumerate(checked)]

    def objects(key: str) -> None:  # rule fn: `{"name": "f", "<key>": <args>}` for any of the functions
        rules.extend(f'fn{i}: {lark_string(_envelope(name, key))} args{i} "}}"' for i, (name, _) in enumerate(checked))
        rules.append("fn: " + " | ".join(f"fn{i}" for i in range(len(checked))))

    if parser_name == HermesParser.name:
        objects("arguments")
        rules.append(f'call: {mark(HermesParser.OPEN)} "\\n" fn "\\n" {mark(HermesParser.CLOSE)}')
        start = 'call ("\\n" call)*' if parallel else "call"
    elif parser_name == Llama3JsonParser.name:
        objects("parameters")
        start = f'{mark(Llama3JsonParser.TAG)}? fn ("; " fn)*' if parallel else f"{mark(Llama3JsonParser.TAG)}? fn"
    elif MistralParser.ARGS in ids:
        for i, (name, _) in enumerate(checked):
            if not MistralParser.NAME.fullmatch(name):  # what the parser reads back before [ARGS]
                raise ValueError(f"function {name!r}: mistral's [ARGS] form takes names of letters, digits, _ . -")
            rules.append(f"fn{i}: {mark(MistralParser.OPEN)} {lark_string(name)} {mark(MistralParser.ARGS)} args{i}")
        rules.append("call: " + " | ".join(f"fn{i}" for i in range(len(checked))))
        start = "call+" if parallel else "call"
    else:  # v3; its tokenizer writes the array after a space (SentencePiece's word prefix), so allow one
        objects("arguments")
        more = '(", " fn)* ' if parallel else ""
        start = f'{mark(MistralParser.OPEN)} " "? "[" fn {more}"]"'
    return "\n".join([f"start: {start}", *rules, *args]) + "\n"


def named_function_grammar(parser_name: str, function: dict[str, Any], markers: dict[str, int] | None = None,
                           *, lenient: bool = False) -> str:
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: exactly one call of that function."""
    return tool_call_grammar(parser_name, [function], parallel=False, markers=markers, lenient=lenient)
