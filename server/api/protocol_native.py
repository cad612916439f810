"""Request and response models of the native endpoints: SGLang's /generate, vLLM's /v1/tokenize and
/v1/detokenize."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from server.api.protocol import ChatMessage


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # see server/api/protocol.py


class NativeSamplingParams(BaseModel):
    """SGLang's `sampling_params` object (its names: max_new_tokens, min_new_tokens, sampling_seed)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    max_new_tokens: int | None = 128  # SGLang's default
    min_new_tokens: int = 0
    # None: the server's sampling defaults (the model's, as SGLang's --sampling-defaults model; else 1, 1, -1, 0, 1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    seed: int | None = Field(default=None, validation_alias="sampling_seed")
    logit_bias: dict[str, float] | None = None
    # SGLang's output constraints (at most one)
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateRequest(_Request):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    rid: str | None = None


class GenerateMeta(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    spec_proposed_tokens: int = 0  # speculative draft tokens verified for this output
    spec_accepted_tokens: int = 0  # of which were accepted (each saved one decode step)
    finish_reason: dict[str, Any] | None  # {"type": "stop" | "length" | "abort", "matched": str | int | None}
    e2e_latency: float | None = None
    # SGLang's layout: [logprob, token id, token text (null: SGLang's return_text_in_logprobs is off)]
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    output_top_logprobs: list[list[tuple[float, int, str | None]]] | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
