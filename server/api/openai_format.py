"""Engine outputs in OpenAI's shapes: logprobs in both APIs' formats, and per-choice accumulation."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from engine.outputs import RequestOutput, TokenLogprob
from server.api.protocol import CompletionLogprobs, PromptTokensDetails, TokenLogprobInfo, TopLogprob, UsageInfo

# JSON has no -inf; vLLM clamps the same way, so clients see a very unlikely token rather than a parse error.
MIN_LOGPROB = -9999.0


def clamp(logprob: float) -> float:
    return MIN_LOGPROB if math.isnan(logprob) else max(logprob, MIN_LOGPROB)


class TokenStrings:
    """The text of single tokens, as logprobs show them (cached: the vocabulary is small, lookups are many)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = str(self._tokenizer.decode([token_id], skip_special_tokens=False))
        return text


class CompletionLogprobsBuilder:
    """Legacy-completions logprobs of one choice, built chunk by chunk; `text_offset` runs over the whole text
    (the echoed prompt included)."""

    def __init__(self, strings: TokenStrings) -> None:
        self._strings = strings
        self._offset = 0
        self.total = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

    def add(self, logprobs: Iterable[TokenLogprob], echoed_prompt: Iterable[int] = ()) -> CompletionLogprobs:
        """The logprobs of new tokens, after those of an echoed prompt. The engine computes no prompt
        logprobs, so prompt tokens get null (as OpenAI's first prompt token always does)."""
        rows: list[tuple[int, float | None, dict[str, float] | None]] = [(t, None, None) for t in echoed_prompt]
        for lp in logprobs:
            top: dict[str, float] = {}
            for token_id, value in lp.top:
                top.setdefault(self._strings(token_id), clamp(value))
            rows.append((lp.token_id, clamp(lp.logprob), top))
        return self._extend(rows)

    def _extend(self, rows: list[tuple[int, float | None, dict[str, float] | None]]) -> CompletionLogprobs:
        # All four fields passed explicitly: stream chunks are serialized with exclude_unset (server/api/sse.py).
        delta = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, logprob, top in rows:
            text = self._strings(token_id)
            delta.tokens.append(text)
            delta.token_logprobs.append(logprob)
            delta.top_logprobs.append(top)
            delta.text_offset.append(self._offset)
            self._offset += len(text)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.total, name).extend(getattr(delta, name))
        return delta


def chat_logprobs(strings: TokenStrings, logprobs: Iterable[TokenLogprob]) -> list[TokenLogprobInfo]:
    """Chat-completions format: one entry per token with its bytes and its top alternatives."""
    out = []
    for lp in logprobs:
        token = strings(lp.token_id)
        top = [TopLogprob(token=strings(t), logprob=clamp(v), bytes=list(strings(t).encode())) for t, v in lp.top]
        out.append(TokenLogprobInfo(token=token, logprob=clamp(lp.logprob), bytes=list(token.encode()),
                                    top_logprobs=top))
    return out


@dataclass
class ChoiceResult:
    """Everything one choice produced, for a non-streaming response."""

    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached_tokens: int = 0
    spec_proposed: int = 0  # speculative draft tokens verified, and accepted (the native API's meta_info)
    spec_accepted: int = 0

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, out: RequestOutput) -> None:
        self.text_parts.append(out.text)
        self.logprobs.extend(out.logprobs or ())
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.spec_proposed, self.spec_accepted = out.spec_proposed, out.spec_accepted
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    """`cached_tokens` counts each prompt once, like `prompt_tokens`: its first choice's cache hit (the other
    choices of n > 1 reuse the prompt that choice computed)."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))
