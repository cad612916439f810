"""What the engine streams back to callers, one `RequestOutput` per step a request takes part in."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    index: int  # which of the n choices this belongs to
    token_ids: tuple[int, ...]  # tokens new since the previous output of this choice
    text: str  # detokenized text new since the previous output (held back near a possible stop string)
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: FinishReason | None  # set on the last output of a choice
    prompt_tokens: int
    completion_tokens: int  # total so far for this choice
    stop_reason: str | int | None = None  # the stop string or token id that ended it, if any
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (0 until admitted)
    metrics: dict[str, float] = field(default_factory=dict)  # on the last output: ttft, e2e, queue time (s)
    embedding: tuple[float, ...] | None = None  # an embedding request's result, on its only output
    spec_proposed: int = 0  # speculative draft tokens verified for this choice so far
    spec_accepted: int = 0  # of which were accepted
