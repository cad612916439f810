"""No silently ignored request fields: the OpenAI, vLLM, SGLang and Anthropic request fields Ember does not
implement are a 400 naming the field when they ask for something (`suffix` non-empty, `use_beam_search: true`, ...), and accepted
when they hold their neutral value (`suffix: ""`, `use_beam_search: false`). The fields OpenAI's own server
treats as hints (`user`, `safety_identifier`, `prompt_cache_key`, `prompt_cache_retention`, `metadata`,
`store: false`, `service_tier: auto|default`, `modalities: ["text"]`, ...) are accepted and ignored. Any other
field nobody knows is ignored, as vLLM does: `check_request_fields` returns their names for one warning line.

`RULES` is the one table of these fields (docs/structured-outputs.md's tables are rendered from it by `markdown_table`, scripts/gen_field_tables.py). The
request models keep undeclared fields in `model_extra` (`ConfigDict(extra="allow")`), which is where a rule
looks, so a field someone implements (declares on the model) stops being refused by itself; a rule marked
`implemented` refuses some values of a declared field (`response_format` of type `structural_tag`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from server.api.errors import APIError

log = logging.getLogger("ember.server")
Endpoint = Literal["chat", "completions", "generate", "messages"]  # messages: /v1/messages and its count_tokens
Neutral = Callable[[Any, BaseModel], bool]  # (value, whole request body) -> True: asks for nothing Ember lacks

CHAT: frozenset[Endpoint] = frozenset({"chat"})
COMPLETIONS: frozenset[Endpoint] = frozenset({"completions"})
OPENAI: frozenset[Endpoint] = frozenset({"chat", "completions"})
GENERATE: frozenset[Endpoint] = frozenset({"generate"})
MESSAGES: frozenset[Endpoint] = frozenset({"messages"})
# The nested models whose undeclared fields are checked too, per endpoint ("" is the body itself).
_OPENAI_WHERE = ("", "stream_options", "structured_outputs")
_WHERE: dict[Endpoint, tuple[str, ...]] = {"chat": _OPENAI_WHERE, "completions": _OPENAI_WHERE,
                                           "generate": ("", "sampling_params"), "messages": ("",)}


@dataclass(frozen=True)
class FieldRule:
    name: str
    endpoints: frozenset[Endpoint]
    source: str  # whose API defines the field: OpenAI, vLLM, SGLang, Anthropic
    neutral: Neutral
    neutral_text: str  # the neutral values in words, for the docs' table
    reason: str | None = None  # why any other value is refused; None: never refused (a hint)
    hint: str | None = None  # accepted and ignored (in its neutral values when `reason` is set too): why that's fine
    where: str = ""  # the nested model holding it: "" (the body), stream_options, structured_outputs, sampling_params
    implemented: bool = False  # the field is declared and served; only the non-neutral values are refused

    @property
    def param(self) -> str:
        return f"{self.where}.{self.name}" if self.where else self.name


def _same(a: Any, b: Any) -> bool:
    """Equality that keeps booleans apart from numbers (`0` is not `false`)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def _one_of(*values: Any) -> Neutral:
    return lambda value, body: value is None or any(_same(value, v) for v in values)


_UNSET = _one_of()
_EMPTY = _one_of("", [], {})
_FALSE = _one_of(False)
_TRUE = _one_of(True)


def _anything(value: Any, body: BaseModel) -> bool:  # a hint: every value is fine
    return True


def _best_of(value: Any, body: BaseModel) -> bool:
    n = getattr(body, "n", None)
    return value is None or _same(value, 1) or _same(value, 1 if n is None else n)


def _no_output_format(value: Any, body: BaseModel) -> bool:
    """Anthropic's output_config asks for nothing Ember lacks unless it names a `format` (effort is a hint)."""
    return value is None or (isinstance(value, dict) and value.get("format") is None)


def _not_structural_tag(value: Any, body: BaseModel) -> bool:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind != "structural_tag"


_TEXT_ONLY = "Ember serves text-only models"
_NO_BEAMS = "Ember has no beam search"
_NO_USER_CODE = "Ember runs no user code in the sampler"
_NO_DISAGG = "Ember does not do disaggregated prefill"
_STOP_TRIMMED = "Ember always removes the matched stop string from the output"
_SHARED_CACHE = "Ember's prefix cache is shared by all requests and cannot be salted"
_OUTPUT_ONLY = "Ember computes logprobs of generated tokens only"


def _rule(name: str, endpoints: frozenset[Endpoint], source: str, neutral: Neutral, neutral_text: str,
          reason: str | None = None, hint: str | None = None, where: str = "", implemented: bool = False) -> FieldRule:
    return FieldRule(name, endpoints, source, neutral, neutral_text, reason, hint, where, implemented)


RULES: tuple[FieldRule, ...] = (
    # ---- OpenAI: hints, accepted and ignored ----
    _rule("user", OPENAI, "OpenAI", _anything, "any", hint="an end-user id for OpenAI's abuse monitoring"),
    _rule("safety_identifier", CHAT, "OpenAI", _anything, "any", hint="an end-user id for OpenAI's abuse monitoring"),
    _rule("prompt_cache_key", CHAT, "OpenAI", _anything, "any",
          hint="routes to OpenAI's prompt cache; Ember's prefix cache matches every prompt by its tokens"),
    _rule("prompt_cache_retention", CHAT, "OpenAI", _anything, "any",
          hint="Ember keeps prefix-cache entries until they are evicted (least recently used first)"),
    _rule("metadata", CHAT, "OpenAI", _anything, "any",
          hint="tags of OpenAI's stored completions; Ember stores nothing"),
    _rule("include_obfuscation", OPENAI, "OpenAI", _anything, "any", where="stream_options",
          hint="pads OpenAI's stream events against side channels; Ember's events carry no padding"),
    # ---- OpenAI: refused unless neutral ----
    _rule("store", CHAT, "OpenAI", _FALSE, "unset or false", reason="Ember does not store completions",
          hint="nothing is stored"),
    _rule("service_tier", CHAT, "OpenAI", _one_of("auto", "default"), 'unset, "auto" or "default"',
          reason="Ember has a single service tier (send auto or default)", hint="Ember has a single service tier"),
    _rule("modalities", CHAT, "OpenAI", _one_of(["text"]), 'unset or ["text"]',
          reason=f"{_TEXT_ONLY}: text is the only output", hint="text is the only output Ember produces"),
    _rule("audio", CHAT, "OpenAI", _UNSET, "unset", reason=f"{_TEXT_ONLY}: no audio output"),
    _rule("prediction", CHAT, "OpenAI", _UNSET, "unset", reason="predicted outputs are not implemented"),
    _rule("functions", CHAT, "OpenAI", _one_of([]), "unset or []", reason="deprecated by OpenAI: use tools"),
    _rule("function_call", CHAT, "OpenAI", _one_of("none"), 'unset or "none"',
          reason="deprecated by OpenAI: use tool_choice"),
    _rule("web_search_options", CHAT, "OpenAI", _UNSET, "unset", reason="Ember has no web search"),
    _rule("reasoning_effort", CHAT, "OpenAI", _one_of("none"), 'unset or "none"',
          reason="Ember has no reasoning-effort control (its chat templates take no such setting)"),
    _rule("verbosity", CHAT, "OpenAI", _one_of("medium"), 'unset or "medium"',
          reason="Ember has no verbosity control (use max_completion_tokens to bound the length)"),
    _rule("suffix", COMPLETIONS, "OpenAI", _EMPTY, 'unset or ""', reason="Ember does not do fill-in-the-middle"),
    _rule("best_of", OPENAI, "OpenAI", _best_of, "unset, 1 or n",
          reason="Ember does not rank candidates server-side (ask for n choices and compare their logprobs)"),
    # ---- vLLM extras ----
    _rule("use_beam_search", OPENAI, "vLLM", _FALSE, "unset or false", reason=_NO_BEAMS),
    _rule("length_penalty", OPENAI, "vLLM", _one_of(1.0), "unset or 1.0", reason=f"a beam-search setting; {_NO_BEAMS}"),
    _rule("include_stop_str_in_output", OPENAI, "vLLM", _FALSE, "unset or false", reason=_STOP_TRIMMED),
    _rule("prompt_logprobs", OPENAI, "vLLM", _UNSET, "unset", reason=_OUTPUT_ONLY),
    _rule("truncate_prompt_tokens", OPENAI, "vLLM", _UNSET, "unset",
          reason="Ember never truncates a prompt (one over the context is a 400)"),
    _rule("guided_decoding_backend", OPENAI, "vLLM", _one_of("auto", "guidance"), 'unset, "auto" or "guidance"',
          reason="Ember has one structured-output backend, llguidance (\"guidance\")"),
    _rule("guided_whitespace_pattern", OPENAI, "vLLM", _UNSET, "unset",
          reason="Ember's JSON grammars take no whitespace pattern"),
    _rule("allowed_token_ids", OPENAI, "vLLM", _UNSET, "unset", reason="not implemented"),
    _rule("bad_words", OPENAI, "vLLM", _one_of([]), "unset or []",
          reason="not implemented (logit_bias -100 bans single tokens)"),
    _rule("logits_processors", OPENAI, "vLLM", _one_of([]), "unset or []", reason=_NO_USER_CODE),
    _rule("return_tokens_as_token_ids", OPENAI, "vLLM", _FALSE, "unset or false", reason="not implemented"),
    _rule("return_token_ids", OPENAI, "vLLM", _FALSE, "unset or false",
          reason="not implemented (/generate returns output_ids)"),
    _rule("priority", OPENAI, "vLLM", _one_of(0), "unset or 0", reason="Ember schedules first come, first served"),
    _rule("cache_salt", OPENAI, "vLLM", _UNSET, "unset", reason=_SHARED_CACHE),
    _rule("kv_transfer_params", OPENAI, "vLLM", _EMPTY, "unset or {}", reason=_NO_DISAGG),
    _rule("vllm_xargs", OPENAI, "vLLM", _EMPTY, "unset or {}", reason="Ember has no request extensions"),
    _rule("response_format", OPENAI, "vLLM", _not_structural_tag, 'type other than "structural_tag"',
          reason="structural tags are not supported", implemented=True),
    _rule("structural_tag", OPENAI, "vLLM", _UNSET, "unset", where="structured_outputs",
          reason="structural tags are not supported"),
    _rule("whitespace_pattern", OPENAI, "vLLM", _UNSET, "unset", where="structured_outputs",
          reason="Ember's JSON grammars take no whitespace pattern"),
    _rule("disable_any_whitespace", OPENAI, "vLLM", _FALSE, "unset or false", where="structured_outputs",
          reason="Ember's JSON grammars take no whitespace settings"),
    _rule("disable_additional_properties", OPENAI, "vLLM", _FALSE, "unset or false", where="structured_outputs",
          reason="not implemented: Ember follows the schema as written"),
    _rule("disable_fallback", OPENAI, "vLLM", _anything, "any", where="structured_outputs",
          hint="Ember has one structured-output backend: there is nothing to fall back to"),
    _rule("add_special_tokens", CHAT, "vLLM", _FALSE, "unset or false",
          reason="the chat template already places the special tokens"),
    _rule("add_special_tokens", COMPLETIONS, "vLLM", _TRUE, "unset or true",
          reason="Ember encodes a text prompt with the tokenizer's special tokens (send token ids to control them)"),
    _rule("prompt_embeds", COMPLETIONS, "vLLM", _UNSET, "unset", reason="Ember takes text or token ids only"),
    _rule("echo", CHAT, "vLLM", _FALSE, "unset or false", reason="not implemented for chat (/v1/completions has it)"),
    _rule("continue_final_message", CHAT, "vLLM", _FALSE, "unset or false",
          reason="not implemented: the reply is always a new assistant message"),
    _rule("documents", CHAT, "vLLM", _one_of([]), "unset or []",
          reason="Ember passes no documents to the chat template"),
    _rule("chat_template", CHAT, "vLLM", _UNSET, "unset", reason="Ember renders the model's own chat template"),
    _rule("mm_processor_kwargs", CHAT, "vLLM", _EMPTY, "unset or {}", reason=_TEXT_ONLY),
    _rule("media_io_kwargs", CHAT, "vLLM", _EMPTY, "unset or {}", reason=_TEXT_ONLY),
    _rule("structural_tag", CHAT, "vLLM", _UNSET, "unset", reason="structural tags are not supported"),
    # ---- SGLang /generate ----
    _rule("data_parallel_rank", GENERATE, "SGLang", _anything, "any", hint="Ember runs one engine: every rank is it"),
    _rule("routed_dp_rank", GENERATE, "SGLang", _anything, "any", hint="Ember runs one engine: every rank is it"),
    _rule("input_embeds", GENERATE, "SGLang", _UNSET, "unset", reason="Ember takes text or input_ids only"),
    _rule("image_data", GENERATE, "SGLang", _UNSET, "unset", reason=_TEXT_ONLY),
    _rule("video_data", GENERATE, "SGLang", _UNSET, "unset", reason=_TEXT_ONLY),
    _rule("audio_data", GENERATE, "SGLang", _UNSET, "unset", reason=_TEXT_ONLY),
    _rule("modalities", GENERATE, "SGLang", _one_of([]), "unset or []", reason=_TEXT_ONLY),
    _rule("logprob_start_len", GENERATE, "SGLang", _one_of(-1), "unset or -1", reason=_OUTPUT_ONLY),
    _rule("token_ids_logprob", GENERATE, "SGLang", _UNSET, "unset", reason="not implemented"),
    _rule("return_text_in_logprobs", GENERATE, "SGLang", _FALSE, "unset or false",
          reason="Ember's logprobs carry token ids (their text entry is null)"),
    _rule("return_hidden_states", GENERATE, "SGLang", _FALSE, "unset or false", reason="not implemented"),
    _rule("return_routed_experts", GENERATE, "SGLang", _FALSE, "unset or false",
          reason="not implemented (the router's choices are not recorded)"),
    _rule("session_params", GENERATE, "SGLang", _UNSET, "unset",
          reason="Ember has no sessions (the prefix cache reuses earlier turns by their tokens)"),
    _rule("lora_path", GENERATE, "SGLang", _UNSET, "unset", reason="Ember serves no LoRA adapters"),
    _rule("lora_id", GENERATE, "SGLang", _UNSET, "unset", reason="Ember serves no LoRA adapters"),
    _rule("custom_logit_processor", GENERATE, "SGLang", _UNSET, "unset", reason=_NO_USER_CODE),
    _rule("bootstrap_host", GENERATE, "SGLang", _UNSET, "unset", reason=_NO_DISAGG),
    _rule("bootstrap_port", GENERATE, "SGLang", _UNSET, "unset", reason=_NO_DISAGG),
    _rule("bootstrap_room", GENERATE, "SGLang", _UNSET, "unset", reason=_NO_DISAGG),
    _rule("priority", GENERATE, "SGLang", _one_of(0), "unset or 0", reason="Ember schedules first come, first served"),
    _rule("extra_key", GENERATE, "SGLang", _UNSET, "unset", reason=_SHARED_CACHE),
    _rule("cache_salt", GENERATE, "SGLang", _UNSET, "unset", reason=_SHARED_CACHE),
    # ---- Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) ----
    _rule("metadata", MESSAGES, "Anthropic", _anything, "any", hint="a user_id for Anthropic's abuse tracking"),
    _rule("thinking", MESSAGES, "Anthropic", _anything, "any",
          hint='only `type: "disabled"` is read (it drops the thinking block); `budget_tokens` is not: the reasoning '
               "parser reports whatever the model thinks, within max_tokens"),
    _rule("cache_control", MESSAGES, "Anthropic", _anything, "any",
          hint="marks what Anthropic's prompt cache writes; Ember's prefix cache matches every prompt by its tokens"),
    _rule("service_tier", MESSAGES, "Anthropic", _anything, "any", hint="Ember has a single service tier"),
    _rule("inference_geo", MESSAGES, "Anthropic", _anything, "any", hint="Ember runs where it is deployed"),
    _rule("speed", MESSAGES, "Anthropic", _anything, "any", hint="Ember decodes at one speed, the fastest it has"),
    _rule("diagnostics", MESSAGES, "Anthropic", _anything, "any",
          hint="Ember explains no cache misses (usage.cache_read_input_tokens shows the prefix-cache hit)"),
    _rule("context_management", MESSAGES, "Anthropic", _anything, "any",
          hint="Ember edits no context: the conversation renders as sent (one over the context is a 400)"),
    _rule("output_config", MESSAGES, "Anthropic", _no_output_format, "unset, or without `format`",
          reason="output formats are not implemented on /v1/messages (/v1/chat/completions' response_format and "
                 "/v1/responses' text.format have them)",
          hint="its `effort` is ignored: Ember's chat templates take no effort setting"),
    _rule("container", MESSAGES, "Anthropic", _UNSET, "unset", reason="Ember runs no code-execution containers"),
    _rule("mcp_servers", MESSAGES, "Anthropic", _one_of([]), "unset or []",
          reason="Ember connects to no MCP servers (pass their tools as `tools`; the client runs them)"),
    # ---- SGLang sampling_params ----
    _rule("stream_interval", GENERATE, "SGLang", _anything, "any", where="sampling_params",
          hint="Ember streams the tokens of every step"),
    _rule("structural_tag", GENERATE, "SGLang", _UNSET, "unset", where="sampling_params",
          reason="structural tags are not supported"),
    _rule("stop_regex", GENERATE, "SGLang", _one_of([]), "unset or []", where="sampling_params",
          reason="Ember matches stop strings, not regular expressions"),
    _rule("no_stop_trim", GENERATE, "SGLang", _FALSE, "unset or false", where="sampling_params", reason=_STOP_TRIMMED),
    _rule("custom_params", GENERATE, "SGLang", _EMPTY, "unset or {}", where="sampling_params", reason=_NO_USER_CODE),
)


def _containers(body: BaseModel, endpoint: Endpoint) -> Iterator[tuple[str, BaseModel]]:
    """(where, model) for the body and each nested model whose fields are checked."""
    for where in _WHERE[endpoint]:
        model = getattr(body, where, None) if where else body
        if isinstance(model, BaseModel):
            yield where, model


def _lookup(model: BaseModel, rule: FieldRule) -> tuple[bool, Any]:
    """(present, value) of the rule's field: undeclared ones from model_extra, declared ones only if implemented."""
    extra = model.model_extra or {}
    if rule.name in extra:
        return True, extra[rule.name]
    if rule.implemented and rule.name in type(model).model_fields:
        return True, getattr(model, rule.name)
    return False, None


MAX_SHOWN_NAMES = 16  # unknown names returned for the log line; the rest are counted
_MAX_NAME_CHARS = 64


def _shown(name: str) -> str:
    """A client-chosen field name as it may go into a log line: escaped unless printable, and cut short."""
    if name and name.isprintable() and len(name) <= _MAX_NAME_CHARS:
        return name
    return ascii(name[:_MAX_NAME_CHARS]) + ("..." if len(name) > _MAX_NAME_CHARS else "")


def check_request_fields(body: BaseModel, endpoint: Endpoint) -> list[str]:
    """Raises APIError(400, param=<field>) for a field Ember does not implement that asks for something (see
    RULES); returns the names of the remaining unknown fields (nested ones as `where.name`, unknown message fields
    as `messages[].name`), which the caller logs as ignored. The names are the client's, so they come back safe to
    log: escaped when not printable, at most 64 characters, at most MAX_SHOWN_NAMES of them and then
    "... (N more)"."""
    unknown: list[str] = []
    for where, model in _containers(body, endpoint):
        known = set()
        for rule in RULES:
            if endpoint not in rule.endpoints or rule.where != where:
                continue
            known.add(rule.name)
            present, value = _lookup(model, rule)
            if present and rule.reason is not None and not rule.neutral(value, body):
                raise APIError(400, f"{rule.param} is not supported: {rule.reason}", param=rule.param,
                               code="unsupported_field")
        prefix = f"{where}." if where else ""
        unknown += [prefix + name for name in (model.model_extra or {}) if name not in known]
    in_messages = dict.fromkeys(f"messages[].{name}" for message in getattr(body, "messages", None) or ()
                                if isinstance(message, BaseModel) for name in (message.model_extra or {}))
    unknown += in_messages  # once each, in order of appearance
    shown = [_shown(name) for name in unknown[:MAX_SHOWN_NAMES]]
    return shown + ([f"... ({len(unknown) - MAX_SHOWN_NAMES} more)"] if len(unknown) > MAX_SHOWN_NAMES else [])


def check_and_log_request_fields(body: BaseModel, endpoint: Endpoint) -> None:
    """What each route calls first: `check_request_fields`, and one warning line naming the ignored fields."""
    ignored = check_request_fields(body, endpoint)
    if ignored:
        log.warning("%s request: ignored unknown fields %s", endpoint, ", ".join(ignored))


def _endpoints_text(endpoints: frozenset[Endpoint]) -> str:
    return ", ".join(e for e in ("chat", "completions", "generate", "messages") if e in endpoints)


def markdown_table(kind: Literal["ignored", "rejected"]) -> str:
    """The docs' table of the fields accepted and ignored (`ignored`: field, endpoints, values, why ignoring
    them is fine) or refused (`rejected`: field, endpoints, the values still accepted, why others are refused)."""
    if kind == "ignored":
        head = "| field | endpoints | accepted values | ignored because |"
        rows = [(r, r.hint) for r in RULES if r.hint is not None]
    else:
        head = "| field | endpoints | accepted values (anything else is a 400) | why |"
        rows = [(r, r.reason) for r in RULES if r.reason is not None]
    lines = [head, "| --- | --- | --- | --- |"]
    lines += [f"| `{r.param}` ({r.source}) | {_endpoints_text(r.endpoints)} | {r.neutral_text} | {why} |"
              for r, why in rows]
    return "\n".join(lines)
