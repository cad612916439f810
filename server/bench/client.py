"""One streaming /v1/completions request of `ember bench`, timed token by token.

The timings are taken when a server-sent event arrives, so they include the server's HTTP and streaming path,
as a user would see them. Output tokens are the server's usage count (stream_options.include_usage) when it
sends one, otherwise the number of chunks that carried text (one token per chunk on Ember, vLLM and
llama-server; a server that merges tokens into one chunk is undercounted, which `tokens_from` records).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class RequestSpec:
    model: str
    max_tokens: int
    temperature: float


@dataclass
class RequestResult:
    start: float  # time.perf_counter() when the request was sent
    end: float = 0.0  # when the stream ended (or failed)
    first_token: float | None = None  # when the first chunk with a choice arrived
    last_token: float | None = None  # when the last chunk with a choice arrived
    text_chunks: int = 0
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server says
    text_parts: list[str] = field(default_factory=list)  # the streamed text (multi-turn conversations reuse it)
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def output_tokens(self) -> int:
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else self.text_chunks

    @property
    def tokens_from(self) -> str:
        return "usage" if self.usage_completion_tokens is not None else "chunks"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def inter_token_latency(self) -> float | None:
        """Mean seconds between tokens after the first (vLLM's TPOT): None with fewer than two tokens."""
        n = self.output_tokens
        if self.first_token is None or self.last_token is None or n < 2:
            return None
        return (self.last_token - self.first_token) / (n - 1)


def completion_body(spec: RequestSpec, prompt: list[int]) -> dict[str, Any]:
    return {"model": spec.model, "prompt": prompt, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def _on_chunk(result: RequestResult, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:
        result.error = f"error event: {json.dumps(chunk['error'])[:300]}"
        return
    choices = chunk.get("choices") or []
    if choices:
        if result.first_token is None:
            result.first_token = now
        result.last_token = now
        texts = [c.get("text") for c in choices if c.get("text")]
        if texts:
            result.text_chunks += 1
            result.text_parts.extend(texts)
    usage = chunk.get("usage")
    if usage:
        result.usage_completion_tokens = int(usage.get("completion_tokens", 0))
        result.usage_prompt_tokens = int(usage.get("prompt_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.usage_cached_tokens = int(details["cached_tokens"])


async def _read_stream(resp: httpx.Response, result: RequestResult) -> None:
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments (": ping"), "event:" lines
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        now = time.perf_counter()
        try:
            _on_chunk(result, json.loads(data), now)
        except (ValueError, TypeError, AttributeError) as exc:
            result.error = f"bad event {data[:120]!r}: {exc}"
        if result.error is not None:
            return
    if not done:
        result.error = "stream ended without data: [DONE]"


async def stream_completion(client: httpx.AsyncClient, spec: RequestSpec, prompt: list[int]) -> RequestResult:
    """Send one streaming completion and time it; failures are recorded in `error`, never raised."""
    result = RequestResult(start=time.perf_counter())
    try:
        async with client.stream("POST", "/v1/completions", json=completion_body(spec, prompt)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
            else:
                await _read_stream(resp, result)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    return result
