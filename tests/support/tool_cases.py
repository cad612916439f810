"""What the tool-call tests share (tests/server/test_tool_parsers.py, test_tool_grammar.py): the functions the
grammars and prompts are built for, and a parsed message reduced to what the tests compare."""
from __future__ import annotations

import json
from typing import Any

from server.api.tool_parsers import ParsedMessage

Summary = tuple[str | None, list[tuple[str, Any]]]


def summary(msg: ParsedMessage) -> Summary:
    return msg.content, [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]


WEATHER: dict[str, Any] = {
    "name": "get_weather",
    # Lark-looking text in a description must not upset the grammar's %json block.
    "description": 'Weather in a city (e.g. Zürich). Units: {celsius} or // fahrenheit # "quoted"\nsecond line',
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
FLIGHT: dict[str, Any] = {
    "name": "book_flight",
    "parameters": {
        "type": "object",
        "properties": {
            "route": {"type": "object",
                      "properties": {"from": {"$ref": "#/$defs/airport"}, "to": {"$ref": "#/$defs/airport"}},
                      "required": ["from", "to"], "additionalProperties": False},
            "passengers": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"], "additionalProperties": False}},
            "budget": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
            "class": {"enum": ["economy", "business"]},
        },
        "required": ["route", "passengers"],
        "additionalProperties": False,
        "$defs": {"airport": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    },
}
NO_PARAMS: dict[str, Any] = {"name": "get_time", "description": "The time now."}
FUNCTIONS = [WEATHER, FLIGHT, NO_PARAMS]
