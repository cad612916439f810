"""What a request asks its output to match: a JSON schema, a regex, a fixed choice, or a grammar.

A spec is plain, hashable data, so it can sit in SamplingParams and key the compile cache; compiling it
(engine/grammar/compiler.py) is what can fail, with a GrammarError naming the request field it came from.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.params_error import SamplingParamsError

GrammarKind = Literal["json_schema", "regex", "choice", "lark", "ebnf", "grammar"]


class GrammarError(SamplingParamsError):
    """The schema or grammar cannot be compiled; rendered as a 400 naming `param`."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    source: str  # JSON text for json_schema and choice; the pattern or grammar text otherwise
    strict: bool = True  # json_schema: unsupported keywords are an error (False: they are ignored)
    param: str = field(default="response_format", compare=False)  # the request field, for error messages
    # A Lark grammar run before this one, which it names `@answer`: free reasoning up to `</think>` when a
    # reasoning parser is active (server/api/reasoning.py), so the constraint applies to the answer only.
    prefix: str | None = None

    @staticmethod
    def json_schema(schema: Any, strict: bool = True, param: str = "response_format") -> GrammarSpec:
        """`schema` as a dict (or bool) or as JSON text. Key order is kept: it is the order of the properties
        in the output."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"{param}: the JSON schema is not valid JSON: {exc}", param) from exc
        if not isinstance(schema, dict | bool):
            raise GrammarError(f"{param}: a JSON schema must be an object", param)
        return GrammarSpec("json_schema", json.dumps(schema), strict, param)

    @staticmethod
    def json_object(param: str = "response_format") -> GrammarSpec:
        """OpenAI's JSON mode: any JSON object."""
        return GrammarSpec.json_schema({"type": "object"}, True, param)

    @staticmethod
    def choice(options: list[str], param: str = "guided_choice") -> GrammarSpec:
        if not options or not all(isinstance(o, str) for o in options):
            raise GrammarError(f"{param} must be a non-empty list of strings", param)
        return GrammarSpec("choice", json.dumps(options), True, param)
