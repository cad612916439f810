"""OpenAI-compatible request and response models (with the vLLM / SGLang sampling extras).

Requests ignore unknown fields, as OpenAI's and vLLM's servers do, so newer clients keep working; a field we
know with a value of the wrong type is a 400 (see server/api/errors.py). Ranges are checked once, by
engine.sampling_params.SamplingParams, so the API and the engine can never disagree about them.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    # Unknown fields are kept in `model_extra` so server/api/request_fields.py can reject the OpenAI and vLLM
    # fields Ember does not implement, by name, and log the rest as ignored.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extra: usage on every chunk (guidellm sends it)


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    # `schema` would shadow a BaseModel attribute: the field is `schema_` under the wire name "schema".
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` object (the successor of its guided_* fields); exactly one is set."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class SamplingFields(_Request):
    """Fields both /v1/completions and /v1/chat/completions take."""

    # Sampling fields accept an explicit null (some clients send one) meaning "the default".
    model: str | None = None  # None: the served model
    temperature: float | None = None  # default 1.0
    top_p: float | None = None  # default 1.0
    n: int | None = None  # default 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, per OpenAI) -> bias in [-100, 100]
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM / SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs (at most one)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark or GBNF (llama.cpp's EBNF dialect), told apart by its syntax
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for legacy completions
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)  # number of top alternatives per token


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both accepted
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True  # vLLM extra
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool | None = None  # default true
    # vLLM extras: variables for the chat template (e.g. Qwen3's enable_thinking), and whether the reasoning a
    # reasoning parser reads out (server/api/reasoning.py) is returned
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True


# ---- responses ----------------------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extra: the stop string or token id that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobInfo] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with a reasoning parser: the <think> block's text
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int  # the call's position in the choice's tool_calls
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "ember"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
