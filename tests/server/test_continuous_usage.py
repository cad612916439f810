"""stream_options.continuous_usage_stats (vLLM's extension, which guidellm sends on every request): with
include_usage, every chunk carries the usage so far, for chat and for completions; the last chunk is the total."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from server_harness import LONG, sse_events

OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def _chunks(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={"model": "tiny-llama", "max_tokens": 6, "stream": True, **LONG,
                                         **body}) as resp:
        assert resp.status_code == 200, resp.read()
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "Once upon a time"}),
])
def test_every_chunk_has_the_usage_so_far(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    chunks = _chunks(http, path, {**body, "stream_options": OPTIONS})
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages), chunks
    prompt = usages[0]["prompt_tokens"]
    completions = [u["completion_tokens"] for u in usages]
    assert completions == sorted(completions) and completions[-1] == 6  # grows to the total
    assert all(u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)
    assert chunks[-1]["choices"] == []  # the usage chunk of include_usage is still last
    texts = [c["choices"][0] for c in chunks if c["choices"]]
    assert any(t.get("text") or (t.get("delta") or {}).get("content") for t in texts)


def test_without_include_usage_it_asks_for_nothing(http: httpx.Client) -> None:
    chunks = _chunks(http, "/v1/completions", {"prompt": "Once", "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in chunks)
