"""Anthropic Messages API request and response models (POST /v1/messages, /v1/messages/count_tokens).

Requests keep unknown fields in `model_extra`, where server/api/request_fields.py's RULES refuse the ones that
ask for something Ember lacks and the route logs the rest as ignored, as the OpenAI models do. Ranges are
checked by engine.sampling_params.SamplingParams, once, as for every other route.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Request):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Request):
    """A thinking block a client hands back in an assistant turn: accepted and left out of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str | None = None


# Anything else (image, document) is a 400 naming the block type.
ContentBlockIn = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                           Field(discriminator="type")]


class MessageIn(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockIn]


class ToolIn(_Request):
    # Anthropic's own name rule; it also satisfies the OpenAI function-name rule the tool machinery checks.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool" only
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Request):
    """`thinking`: "disabled" drops the reasoning from the response; otherwise (and budget_tokens) it is ignored,
    as a reasoning parser reports whatever the model thinks."""

    type: str
    budget_tokens: int | None = None


class CountTokensRequest(_Request):
    """What renders the prompt: count_tokens takes exactly this; a message request adds generation fields."""

    model: str | None = None  # None: the served model (Anthropic requires it; a client always sends one)
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as in Anthropic's API
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted and ignored (Anthropic's user_id for abuse tracking)
    thinking: ThinkingConfig | None = None


# ---- responses ----------------------------------------------------------------------------------------------
class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Ember signs nothing; the SDKs expect the field


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str  # "toolu_" + hex
    name: str
    input: dict[str, Any]


# A reasoning parser's thinking block goes first in this list when there is one.
ContentBlockOut = ThinkingOut | TextOut | ToolUseOut
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    input_tokens: int  # prompt tokens not read from the prefix cache (Anthropic's meaning)
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    cache_creation_input_tokens: int = 0  # Ember caches implicitly: nothing is billed as written


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlockOut]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int
