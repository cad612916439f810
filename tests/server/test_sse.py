"""The hand-rendered per-token SSE events are byte-identical to the pydantic chunks they stand in for."""
from __future__ import annotations

import json

import pytest

from server.api.protocol import ChatCompletionChunk, ChatDelta, ChatStreamChoice, CompletionChoice, CompletionChunk
from server.api.sse import ChunkFrame, event

TEXTS = ["", " hello", 'quote " and back\\slash', "new\nline\ttab\r\x01\x1f\x7f", "é€😀", "\u2028\u2029", "</script>"]


def _pydantic(chunk: CompletionChunk | ChatCompletionChunk, include_usage: bool) -> str:
    if include_usage:
        chunk.usage = None  # as server/api/openai_stream.py sets it on every chunk but the last
    return event(chunk)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish,stop", [(None, None), ("stop", "\n\n"), ("stop", 7), ("length", None)])
def test_completion_event_matches_pydantic(include_usage: bool, text: str, finish: str | None,
                                           stop: str | int | None) -> None:
    frame = ChunkFrame('cmpl-"x"', "text_completion", 1700000000, "my/modèl", include_usage)
    want = _pydantic(CompletionChunk(id='cmpl-"x"', object="text_completion", created=1700000000, model="my/modèl",
                                     choices=[CompletionChoice(index=3, text=text, logprobs=None, finish_reason=finish,
                                                               stop_reason=stop)]), include_usage)
    got = frame.completion(3, text, finish, stop)
    assert got == want
    assert json.loads(got.removeprefix("data: "))["choices"][0]["text"] == text


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS[1:])
def test_chat_content_event_matches_pydantic(include_usage: bool, text: str) -> None:
    frame = ChunkFrame("chatcmpl-1", "chat.completion.chunk", 5, "model", include_usage)
    want = _pydantic(ChatCompletionChunk(id="chatcmpl-1", object="chat.completion.chunk", created=5, model="model",
                                         choices=[ChatStreamChoice(index=0, delta=ChatDelta(content=text),
                                                                   logprobs=None, finish_reason=None)]),
                     include_usage)
    assert frame.chat_content(0, text) == want
