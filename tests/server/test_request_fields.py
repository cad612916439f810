"""server/api/request_fields.py on the real request models: the fields Ember does not implement are a 400 naming
the field unless they hold a neutral value, OpenAI's and Anthropic's hints are accepted and ignored, and every other
unknown field (nested ones included) comes back by name for the warning line."""
from __future__ import annotations

import typing
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.api.protocol_anthropic import MessagesRequest
from server.api.protocol_native import GenerateRequest
from server.api.request_fields import MAX_SHOWN_NAMES, RULES, Endpoint, check_request_fields, markdown_table

MESSAGES = [{"role": "user", "content": "hi"}]
MODELS: dict[Endpoint, type[BaseModel]] = {"chat": ChatCompletionRequest, "completions": CompletionRequest,
                                           "generate": GenerateRequest, "messages": MessagesRequest}


def nested_model(model: type[BaseModel], field: str) -> type[BaseModel]:
    """The pydantic model a field of `model` holds (`stream_options: StreamOptions | None` -> StreamOptions)."""
    annotation = model.model_fields[field].annotation
    candidates = (*typing.get_args(annotation), annotation)
    (inner,) = [t for t in candidates if isinstance(t, type) and issubclass(t, BaseModel)]
    return inner


def body(endpoint: Endpoint, **fields: Any) -> BaseModel:
    base: dict[str, Any] = {"chat": {"messages": MESSAGES}, "completions": {"prompt": "hi"},
                            "generate": {"text": "hi"}, "messages": {"max_tokens": 4, "messages": MESSAGES}}[endpoint]
    return MODELS[endpoint].model_validate({**base, **fields})


def rejected(endpoint: Endpoint, **fields: Any) -> APIError:
    with pytest.raises(APIError) as exc:
        check_request_fields(body(endpoint, **fields), endpoint)
    assert exc.value.status == 400 and exc.value.code == "unsupported_field", exc.value.message
    return exc.value


REJECTED: list[tuple[Endpoint, dict[str, Any], str]] = [
    # OpenAI
    ("completions", {"suffix": "}"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"best_of": 3, "n": 2}, "best_of"),
    ("chat", {"best_of": 2}, "best_of"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"verbosity": "low"}, "verbosity"),
    ("chat", {"store": True}, "store"),
    ("chat", {"store": 1}, "store"),  # only a real false asks for nothing
    ("chat", {"service_tier": "flex"}, "service_tier"),
    # vLLM
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("chat", {"length_penalty": 0.5}, "length_penalty"),
    ("completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("completions", {"prompt_logprobs": 0}, "prompt_logprobs"),  # 0 still asks for the prompt tokens' own logprobs
    ("chat", {"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ("chat", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("chat", {"bad_words": ["x"]}, "bad_words"),
    ("chat", {"logits_processors": ["pkg.Proc"]}, "logits_processors"),
    ("completions", {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),
    ("chat", {"documents": [{"title": "t", "text": "x"}]}, "documents"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat", {"mm_processor_kwargs": {"fps": 1}}, "mm_processor_kwargs"),
    ("completions", {"priority": 1}, "priority"),
    ("chat", {"structural_tag": "{}"}, "structural_tag"),
    ("completions", {"add_special_tokens": False}, "add_special_tokens"),
    ("chat", {"add_special_tokens": True}, "add_special_tokens"),
    ("completions", {"cache_salt": "s3cret"}, "cache_salt"),
    # SGLang /generate
    ("generate", {"lora_path": "adapter"}, "lora_path"),
    ("generate", {"return_hidden_states": True}, "return_hidden_states"),
    ("generate", {"image_data": "https://example.com/a.png"}, "image_data"),
    ("generate", {"custom_logit_processor": "{}"}, "custom_logit_processor"),
    ("generate", {"logprob_start_len": 0}, "logprob_start_len"),
    ("generate", {"sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
    ("generate", {"sampling_params": {"no_stop_trim": True}}, "sampling_params.no_stop_trim"),
    ("completions", {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ("chat", {"structured_outputs": {"json": {}, "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    # Anthropic /v1/messages
    ("messages", {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "output_config"),
    ("messages", {"output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {}}}},
     "output_config"),
    ("messages", {"container": "container_1"}, "container"),
    ("messages", {"mcp_servers": [{"type": "url", "url": "https://mcp.example/sse", "name": "x"}]}, "mcp_servers"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), REJECTED, ids=[f"{e}-{p}" for e, _, p in REJECTED])
def test_unimplemented_field_with_a_value_is_a_400_naming_it(endpoint: Endpoint, fields: dict[str, Any],
                                                             param: str) -> None:
    error = rejected(endpoint, **fields)
    assert error.param == param
    assert error.message.startswith(f"{param} is not supported: "), error.message


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_structural_tag_response_format_is_refused(endpoint: Endpoint) -> None:
    fields = {"response_format": {"type": "structural_tag", "structures": [], "triggers": []}}
    try:
        request = body(endpoint, **fields)
    except ValidationError:
        return  # the declared response_format refuses the type itself (a 400 from validation)
    with pytest.raises(APIError) as exc:
        check_request_fields(request, endpoint)
    assert exc.value.status == 400 and exc.value.param == "response_format"


def test_messages_say_why() -> None:
    suffix = rejected("completions", suffix="x").message
    assert suffix == "suffix is not supported: Ember does not do fill-in-the-middle"
    assert "use tools" in rejected("chat", functions=[{"name": "f"}]).message
    assert "use tool_choice" in rejected("chat", function_call={"name": "f"}).message
    assert "beam search" in rejected("completions", use_beam_search=True).message


NEUTRAL: list[tuple[Endpoint, dict[str, Any]]] = [
    ("completions", {"suffix": None}), ("completions", {"suffix": ""}),
    ("completions", {"best_of": 1}), ("completions", {"best_of": 2, "n": 2}), ("chat", {"best_of": None}),
    ("chat", {"audio": None, "prediction": None, "web_search_options": None, "functions": [],
              "function_call": "none", "reasoning_effort": None, "verbosity": "medium"}),
    ("completions", {"use_beam_search": False, "length_penalty": 1, "include_stop_str_in_output": False,
                     "prompt_logprobs": None, "truncate_prompt_tokens": None, "guided_decoding_backend": "guidance",
                     "allowed_token_ids": None, "bad_words": [], "logits_processors": None, "priority": 0,
                     "return_tokens_as_token_ids": False, "add_special_tokens": True, "cache_salt": None}),
    ("chat", {"echo": False, "continue_final_message": False, "documents": None, "chat_template": None,
              "chat_template_kwargs": {}, "mm_processor_kwargs": None, "add_special_tokens": False,
              "guided_decoding_backend": "auto", "include_reasoning": True}),
    ("chat", {"response_format": {"type": "json_object"}}),
    ("chat", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}),
    ("generate", {"lora_path": None, "return_hidden_states": False, "logprob_start_len": -1, "image_data": None,
                  "sampling_params": {"structural_tag": None, "no_stop_trim": False, "stop_regex": []}}),
    ("messages", {"output_config": {"effort": "low"}, "container": None, "mcp_servers": []}),
    ("messages", {"output_config": {"format": None}}),
]


@pytest.mark.parametrize(("endpoint", "fields"), NEUTRAL)
def test_neutral_values_are_accepted_and_not_reported(endpoint: Endpoint, fields: dict[str, Any]) -> None:
    assert check_request_fields(body(endpoint, **fields), endpoint) == []


def test_openai_hints_are_accepted_and_ignored() -> None:
    hints = {"user": "u-1", "safety_identifier": "h-1", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
             "metadata": {"team": "a"}, "store": False, "service_tier": "auto", "modalities": ["text"]}
    assert check_request_fields(body("chat", **hints), "chat") == []
    assert check_request_fields(body("chat", service_tier="default"), "chat") == []
    assert check_request_fields(body("completions", user="u-1"), "completions") == []
    streamed = body("completions", stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    assert check_request_fields(streamed, "completions") == []


def test_anthropic_hints_are_accepted_and_ignored() -> None:
    """What Claude Code and the anthropic SDK send beside the served fields asks for nothing a local server lacks."""
    hints = {"cache_control": {"type": "ephemeral"}, "service_tier": "standard_only", "inference_geo": "eu",
             "speed": "fast", "diagnostics": {"previous_message_id": "msg_1"}, "metadata": {"user_id": "u"},
             "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
             "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert check_request_fields(body("messages", **hints), "messages") == []
    # Anthropic's hints are not OpenAI's: on chat, speed is just unknown, and output_config is no chat field.
    assert check_request_fields(body("chat", speed="fast", output_config={"format": {}}), "chat") == [
        "speed", "output_config"]
    assert check_request_fields(body("messages", foo=1), "messages") == ["foo"]


def test_other_unknown_fields_come_back_by_name_nested_ones_with_their_path() -> None:
    chat = body("chat", foo=1, stream=True, stream_options={"include_usage": True, "bar": 2},
                messages=[{"role": "user", "content": "hi", "qux": 3}, {"role": "user", "content": "x", "qux": 4}])
    assert check_request_fields(chat, "chat") == ["foo", "stream_options.bar", "messages[].qux"]
    generate = body("generate", foo=1, sampling_params={"max_new_tokens": 4, "baz": True, "stream_interval": 2})
    assert check_request_fields(generate, "generate") == ["foo", "sampling_params.baz"]


def test_unknown_names_come_back_safe_to_log() -> None:
    odd = body("completions", **{"a\nb": 1, "": 2, "x" * 100: 3})
    assert check_request_fields(odd, "completions") == ["'a\\nb'", "''", ascii("x" * 64) + "..."]
    many = body("completions", **{f"f{i}": i for i in range(MAX_SHOWN_NAMES + 3)})
    names = check_request_fields(many, "completions")
    assert names == [f"f{i}" for i in range(MAX_SHOWN_NAMES)] + ["... (3 more)"]


def test_rules_apply_to_their_own_endpoints_only() -> None:
    # suffix is a completions field: on chat it is just unknown; echo is implemented by /v1/completions.
    assert check_request_fields(body("chat", suffix="x"), "chat") == ["suffix"]
    assert check_request_fields(body("completions", echo=True), "completions") == []
    # SGLang's modalities (of image data) differ from OpenAI's (of the output).
    assert rejected("generate", modalities=["image"]).param == "modalities"
    assert check_request_fields(body("generate", modalities=[]), "generate") == []


def test_the_table_is_not_stale() -> None:
    """A refused field the request model declares has been implemented: its rule must go (or be marked
    `implemented`, refusing only some of its values). Each (field, endpoint, place) has one rule."""
    seen = set()
    for rule in RULES:
        for endpoint in rule.endpoints:
            model = nested_model(MODELS[endpoint], rule.where) if rule.where else MODELS[endpoint]
            if rule.reason is not None and not rule.implemented:
                assert rule.name not in model.model_fields, f"{rule.param} is declared on {model.__name__}"
            key = (rule.name, endpoint, rule.where)
            assert key not in seen, key
            seen.add(key)
        assert rule.reason is not None or rule.hint is not None, rule.name


def test_markdown_tables_list_each_rule_in_its_kind() -> None:
    ignored, refused = markdown_table("ignored").splitlines(), markdown_table("rejected").splitlines()
    assert len(ignored) == 2 + sum(r.hint is not None for r in RULES)
    assert len(refused) == 2 + sum(r.reason is not None for r in RULES)
    assert any(line.startswith("| `user` (OpenAI) | chat, completions | any |") for line in ignored)
    assert any(line.startswith('| `store` (OpenAI) | chat | unset or false |') for line in refused)
    assert any(line.startswith("| `sampling_params.structural_tag` (SGLang) | generate |") for line in refused)
    assert any(line.startswith("| `cache_control` (Anthropic) | messages | any |") for line in ignored)
    assert any(line.startswith("| `output_config` (Anthropic) | messages | unset, or without `format` |")
               for line in refused)
    assert all(line.count("|") == 5 for line in ignored + refused)
