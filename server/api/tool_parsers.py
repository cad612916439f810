"""Tool calls in model output: one parser per trained format (hermes, llama3_json, mistral), whole-text and
streaming, plus the text forms Ember writes into prompts for models whose chat template has no tool support.

Every parser is one function, `_scan(buf, mode, final)`, which decides as much of `buf` as it can and says how
many characters it used. `parse` is that scan run once with `final=True`; a stream runs it on each delta over
the text it has not yet decided. The scans only decide what no later text can change (a marker is found, a
JSON value is complete), so every split of the text into deltas gives the same content and calls as `parse`.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, NamedTuple

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str  # "call_" + 24 random hex chars, made at parse time


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # text outside tool calls, stripped; None when empty
    tool_calls: list[ToolCall]


Event = str | ToolCall


class Mode(Enum):
    """Where a scan stands; only llama3_json, whose calls must open the output, needs more than START."""
    START = "start"  # nothing decided yet
    CALLS = "calls"  # just after a complete call
    TEXT = "text"  # decided: everything from here on is content


class _Scan(NamedTuple):
    events: list[Event]
    used: int  # characters of the buffer decided; the rest is kept for the next scan
    mode: Mode


class _Verdict(Enum):
    NO = "no"  # not a call: the marker is content, scanning goes on after it
    WAIT = "wait"  # the text so far could still become a call; at the end of the output it is NO


@dataclass(frozen=True)
class _Calls:
    calls: list[ToolCall]
    end: int  # where the calls' text ends in the buffer


def _json_at(buf: str, at: int, opener: str) -> tuple[Any, int] | _Verdict:
    """The JSON object or array opening with `opener` at `at`, and where it ends. Only these two are decoded:
    they close themselves, so one complete in a prefix of the output is the same in the whole output."""
    if at == len(buf):
        return _Verdict.WAIT
    if buf[at] != opener:
        return _Verdict.NO
    try:
        return _DECODER.raw_decode(buf, at)
    except (ValueError, RecursionError):  # incomplete, or malformed: only the end of the output tells
        return _Verdict.WAIT


def _tool_call(obj: object, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from a decoded JSON object, or None when it is not one (then its text is content)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in arg_keys if k in obj), None)
    if isinstance(args, str):  # some models write the arguments as a JSON string
        found = _json_at(args.strip(), 0, "{")
        args = found[0] if isinstance(found, tuple) else None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), "call_" + secrets.token_hex(12))


def _skip_ws(buf: str, at: int) -> int:
    while at < len(buf) and buf[at].isspace():
        at += 1
    return at


def _held_back(buf: str, start: int, marker: str) -> int:
    """How many trailing characters of buf[start:] could be the beginning of `marker`."""
    for k in range(min(len(marker) - 1, len(buf) - start), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class ToolParser:
    name: ClassVar[str]

    def parse(self, text: str) -> ParsedMessage:
        stream = self.stream()
        events = stream.feed(text) + stream.finish()
        content = "".join(e for e in events if isinstance(e, str))
        return ParsedMessage(content or None, [e for e in events if isinstance(e, ToolCall)])

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def _scan(self, buf: str, mode: Mode, final: bool) -> _Scan:
        raise NotImplementedError


class ToolStream:
    """Incremental parsing: content deltas and completed calls, in order. Content is stripped as `parse` strips
    it: leading whitespace is dropped, trailing whitespace is held until more content follows."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser, self._buf, self._mode = parser, "", Mode.START
        self._started, self._ws = False, ""

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> list[Event]:
        return self._step(final=True)  # whitespace still held is the content's trailing whitespace: dropped

    def _step(self, final: bool) -> list[Event]:
        scan = self._parser._scan(self._buf, self._mode, final)
        self._buf, self._mode = self._buf[scan.used:], scan.mode
        out: list[Event] = []
        for e in scan.events:
            if isinstance(e, ToolCall):
                out.append(e)
                continue
            if not self._started:
                e = e.lstrip()
                self._started = bool(e)
            text = self._ws + e
            kept = text.rstrip()
            self._ws = text[len(kept):]
            if kept:
                out.append(kept)
        return out


class _MarkedParser(ToolParser):
    """Formats whose calls begin at a marker anywhere in the text; the text around them is content."""
    OPEN: ClassVar[str]

    def _calls_at(self, buf: str, at: int) -> _Calls | _Verdict:
        """The calls whose text starts at `at`, just after a marker."""
        raise NotImplementedError

    def _scan(self, buf: str, mode: Mode, final: bool) -> _Scan:
        events: list[Event] = []
        pos = 0
        while True:
            i = buf.find(self.OPEN, pos)
            if i < 0:
                end = len(buf) if final else len(buf) - _held_back(buf, pos, self.OPEN)
                return _Scan(events + [buf[pos:end]], end, mode)
            events.append(buf[pos:i])
            found = self._calls_at(buf, i + len(self.OPEN))
            if found is _Verdict.WAIT and not final:
                return _Scan(events, i, mode)
            if isinstance(found, _Calls):
                events.extend(found.calls)
                pos = found.end
            else:  # a malformed or unterminated call: its marker and text are content
                events.append(self.OPEN)
                pos = i + len(self.OPEN)


class HermesParser(_MarkedParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated, text around (Qwen, Hermes)."""
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _calls_at(self, buf: str, at: int) -> _Calls | _Verdict:
        # The JSON first, then the closing tag: an argument may itself contain "</tool_call>".
        found = _json_at(buf, _skip_ws(buf, at), "{")
        if isinstance(found, _Verdict):
            return found
        close = _skip_ws(buf, found[1])
        if not buf.startswith(self.CLOSE, close):
            return _Verdict.WAIT if self.CLOSE.startswith(buf[close:]) else _Verdict.NO
        call = _tool_call(found[0])
        return _Calls([call], close + len(self.CLOSE)) if call is not None else _Verdict.NO


class MistralParser(_MarkedParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3) or `[TOOL_CALLS]name[ARGS]{...}`, repeated."""
    name = "mistral"
    OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"
    NAME = re.compile(r"[A-Za-z0-9_.\-]*")

    def _calls_at(self, buf: str, at: int) -> _Calls | _Verdict:
        at = _skip_ws(buf, at)
        if at == len(buf):
            return _Verdict.WAIT
        if buf[at] == "[":  # v3: one JSON array of calls
            found = _json_at(buf, at, "[")
            if isinstance(found, _Verdict):
                return found
            calls = [_tool_call(c, ("arguments",)) for c in found[0]] if isinstance(found[0], list) else []
            ok = [c for c in calls if c is not None]
            return _Calls(ok, found[1]) if ok and len(ok) == len(calls) else _Verdict.NO
        m = self.NAME.match(buf, at)
        name_end = m.end() if m else at
        if name_end == at:
            return _Verdict.NO
        if not buf.startswith(self.ARGS, name_end):
            partial = name_end == len(buf) or self.ARGS.startswith(buf[name_end:])
            return _Verdict.WAIT if partial else _Verdict.NO
        found = _json_at(buf, _skip_ws(buf, name_end + len(self.ARGS)), "{")
        if isinstance(found, _Verdict):
            return found
        call = _tool_call({"name": buf[at:name_end], "arguments": found[0]})
        return _Calls([call], found[1]) if call is not None else _Verdict.NO


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2 JSON calls: the whole output is `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several joined by `;`. Calls must open the output: JSON that is not a call is content
    (a user may well ask for JSON), and so is whatever follows the last call that is not another one."""
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _scan(self, buf: str, mode: Mode, final: bool) -> _Scan:
        events: list[Event] = []
        pos = 0
        while mode is not Mode.TEXT:
            # The first call may follow the tag; each further one follows a `;`.
            i = _skip_ws(buf, pos)
            sep = self.TAG if mode is Mode.START else ";"
            has_sep = buf.startswith(sep, i)
            j = _skip_ws(buf, i + len(sep)) if has_sep else i
            if j == len(buf) or (not has_sep and sep.startswith(buf[i:])):  # nothing after it yet
                if not final:
                    return _Scan(events, pos, mode)
                if mode is Mode.CALLS:  # the output ends after its calls (a trailing `;` is dropped)
                    return _Scan(events, len(buf), mode)
                break
            found = self._call_at(buf, j) if has_sep or mode is Mode.START else _Verdict.NO
            if found is _Verdict.WAIT and not final:
                return _Scan(events, pos, mode)
            if not isinstance(found, _Calls):
                break
            events.extend(found.calls)
            pos, mode = found.end, Mode.CALLS
        return _Scan(events + [buf[pos:]], len(buf), Mode.TEXT)

    @staticmethod
    def _call_at(buf: str, at: int) -> _Calls | _Verdict:
        found = _json_at(buf, at, "{")
        if isinstance(found, _Verdict):
            return found
        call = _tool_call(found[0])
        return _Calls([call], found[1]) if call is not None else _Verdict.NO


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
_LLAMA3_PHRASE = re.compile(r'\\?"name\\?": function name, \\?"parameters\\?"')
_JINJA_BLOCK = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.DOTALL)
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)


def _template_texts(chat_template: str | dict[str, str] | None) -> list[str]:
    if chat_template is None:
        return []
    return [chat_template] if isinstance(chat_template, str) else [t for t in chat_template.values() if t]


def parser_for_template(chat_template: str | dict[str, str] | None, override: str | None = None) -> ToolParser:
    """The parser for a model: `override` (the --tool-call-parser flag) if given, else the format its chat
    template writes tool calls in; hermes when the template has none (Ember then prompts for that format)."""
    if override is not None:
        if override not in PARSERS:
            raise ValueError(f"unknown tool-call parser {override!r}; valid: {', '.join(sorted(PARSERS))}")
        return PARSERS[override]()
    text = "\n".join(_template_texts(chat_template))
    if HermesParser.OPEN in text:
        return HermesParser()
    if MistralParser.OPEN in text:
        return MistralParser()
    if Llama3JsonParser.TAG in text or _LLAMA3_PHRASE.search(text):
        return Llama3JsonParser()
    return HermesParser()


def template_supports_tools(chat_template: str | dict[str, str] | None) -> bool:
    """Whether the template reads the `tools` variable: the word in a Jinja block, outside its string literals
    (`{{ 'no tools here' }}` does not count)."""
    blocks = [_STRING.sub("", b) for t in _template_texts(chat_template) for b in _JINJA_BLOCK.findall(t)]
    return any(re.search(r"\btools\b", b) for b in blocks)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """The function object of an OpenAI tool entry ({"type": "function", "function": {...}}) or a bare one."""
    fn = tool.get("function", tool)
    return fn if isinstance(fn, dict) else {}


def tool_system_prompt(tools: list[dict[str, Any]]) -> str:
    """System-prompt text that teaches the Hermes convention to a model whose template has no tool support."""
    listed = "\n".join(json.dumps({"type": "function", "function": _function(t)}, ensure_ascii=False) for t in tools)
    return ("# Tools\n\n"
            "You can call functions to help with the user's request. Their signatures, as JSON schemas, are listed "
            f"inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
            "To call a function, reply with one block per call, each holding a JSON object with the function's "
            "name and its arguments, exactly like this:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
            "If no function is needed, answer in plain text.")


def render_tool_calls(parser_name: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls as the model would write them, for assistant messages in a history rendered as plain text."""
    def obj(name: str, args: dict[str, Any], key: str = "arguments") -> str:
        return json.dumps({"name": name, key: args}, ensure_ascii=False)
    if parser_name == HermesParser.name:
        return "\n".join(f"{HermesParser.OPEN}\n{obj(n, a)}\n{HermesParser.CLOSE}" for n, a in calls)
    if parser_name == Llama3JsonParser.name:
        return "; ".join(obj(n, a, "parameters") for n, a in calls)
    if parser_name == MistralParser.name:
        return MistralParser.OPEN + "[" + ", ".join(obj(n, a) for n, a in calls) + "]"
    raise ValueError(f"unknown tool-call parser {parser_name!r}; valid: {', '.join(sorted(PARSERS))}")


def render_tool_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"
