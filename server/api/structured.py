"""The structured-output fields of a request, as the one GrammarSpec that constrains its output.

Accepted forms (at most one per request): OpenAI's `response_format` (json_object, json_schema), vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and their successor `structured_outputs`,
and SGLang's `json_schema` / `regex` / `ebnf` in the sampling_params of /generate. Compiling happens on the
grammar thread (`compile_grammar`), never on the event loop or the engine thread.
"""
from __future__ import annotations

import asyncio
from typing import Any

from engine.grammar.spec import GrammarSpec
from server.api.errors import APIError
from server.api.protocol import ResponseFormat, SamplingFields, StructuredOutputs
from server.api.state import ServerState


def _response_format(rf: ResponseFormat) -> GrammarSpec | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec.json_object()
    if rf.type == "structural_tag":
        raise APIError(400, "response_format type 'structural_tag' is not supported", param="response_format.type")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                       param="response_format.json_schema")
    # OpenAI's default is strict false; either way the output is constrained. Strict only decides whether
    # schema keywords the grammar compiler does not implement are an error (strict) or ignored.
    return GrammarSpec.json_schema(rf.json_schema.schema_, strict=bool(rf.json_schema.strict),
                                   param="response_format.json_schema.schema")


def _structured_outputs(so: StructuredOutputs) -> list[GrammarSpec]:
    specs = []
    if so.json_ is not None:
        specs.append(GrammarSpec.json_schema(so.json_, param="structured_outputs.json"))
    if so.regex is not None:
        specs.append(GrammarSpec("regex", so.regex, param="structured_outputs.regex"))
    if so.choice is not None:
        specs.append(GrammarSpec.choice(so.choice, param="structured_outputs.choice"))
    if so.grammar is not None:
        specs.append(GrammarSpec("grammar", so.grammar, param="structured_outputs.grammar"))
    if so.json_object:
        specs.append(GrammarSpec.json_object(param="structured_outputs.json_object"))
    return specs


def _one(specs: list[tuple[str, GrammarSpec | None]]) -> GrammarSpec | None:
    given = [(name, s) for name, s in specs if s is not None]
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"give at most one output constraint; this request has {names}", param=given[1][0])
    return given[0][1] if given else None


def request_grammar(req: SamplingFields) -> GrammarSpec | None:
    """The output constraint of an OpenAI-style request (raises APIError / GrammarError, both 400s)."""
    specs: list[tuple[str, GrammarSpec | None]] = [
        ("response_format", _response_format(req.response_format) if req.response_format else None),
        ("guided_json", None if req.guided_json is None else GrammarSpec.json_schema(req.guided_json,
                                                                                      param="guided_json")),
        ("guided_regex", None if req.guided_regex is None else GrammarSpec("regex", req.guided_regex,
                                                                            param="guided_regex")),
        ("guided_choice", None if req.guided_choice is None else GrammarSpec.choice(req.guided_choice)),
        ("guided_grammar", None if req.guided_grammar is None else GrammarSpec("grammar", req.guided_grammar,
                                                                                param="guided_grammar")),
    ]
    if req.structured_outputs is not None:
        so = _structured_outputs(req.structured_outputs)
        specs += [("structured_outputs", s) for s in so]
    return _one(specs)


def native_grammar(json_schema: str | dict[str, Any] | None, regex: str | None,
                   ebnf: str | None) -> GrammarSpec | None:
    """SGLang's sampling_params constraint fields."""
    return _one([
        ("sampling_params.json_schema", None if json_schema is None else GrammarSpec.json_schema(
            json_schema, param="sampling_params.json_schema")),
        ("sampling_params.regex", None if regex is None else GrammarSpec("regex", regex,
                                                                         param="sampling_params.regex")),
        ("sampling_params.ebnf", None if ebnf is None else GrammarSpec("ebnf", ebnf, param="sampling_params.ebnf")),
    ])


async def compile_grammar(state: ServerState, spec: GrammarSpec | None) -> None:
    """Compile (or find cached) on the grammar thread; raises GrammarError (a 400) for a bad schema/grammar."""
    if spec is not None:
        await asyncio.get_running_loop().run_in_executor(state.grammar_pool, state.core.grammars.compile, spec)
