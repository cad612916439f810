"""The SSE bodies of streaming /v1/completions and /v1/chat/completions.

Chat: one role chunk per choice first, then content deltas as the engine produces them, then one chunk per
choice with its finish_reason, then (with stream_options.include_usage) a usage chunk with no choices, then
`data: [DONE]`. An error after the 200 has been sent becomes an error event followed by [DONE].
"""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from engine.outputs import RequestOutput
from server.api.chat_tools import finish_reason
from server.api.generation import TaggedOutputs
from server.api.openai_format import CompletionLogprobsBuilder, TokenStrings, chat_logprobs, usage
from server.api.protocol import (
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    FunctionCallDelta,
    StreamOptions,
    ToolCallDelta,
    UsageInfo,
)
from server.api.reasoning import ReasoningParser, Start
from server.api.sse import DONE, ChunkFrame, error_event, event
from server.api.tool_parsers import ToolParser, ToolStream


@dataclass(frozen=True)
class StreamSpec:
    request_id: str
    model: str
    n: int  # choices per prompt
    prompt_tokens: int  # summed over prompts
    include_usage: bool
    logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))  # the same on every chunk of a stream
    # stream_options.continuous_usage_stats (with include_usage, as vLLM has it): usage so far on every chunk
    continuous_usage: bool = False


def usage_options(options: StreamOptions | None) -> tuple[bool, bool]:
    """(include_usage, continuous usage): continuous_usage_stats counts only with include_usage, as in vLLM."""
    if options is None:
        return False, False
    return options.include_usage, options.include_usage and options.continuous_usage_stats


@dataclass
class _Tally:
    """Token counts for the usage chunk, gathered while streaming."""

    done_tokens: dict[int, int] = field(default_factory=dict)  # choice -> completion tokens when it finished
    cached: dict[int, int] = field(default_factory=dict)  # prompt -> its first choice's cached prompt tokens
    so_far: dict[int, int] = field(default_factory=dict)  # choice -> completion tokens up to its latest output

    def add(self, index: int, prompt_idx: int, out: RequestOutput) -> None:
        if out.index == 0:
            self.cached[prompt_idx] = out.cached_tokens
        self.so_far[index] = out.completion_tokens
        if out.finish_reason is not None:
            self.done_tokens[index] = out.completion_tokens

    def current(self, spec: StreamSpec) -> UsageInfo:
        return usage(spec.prompt_tokens, sum(self.so_far.values()), sum(self.cached.values()))


async def _with_usage(spec: StreamSpec, body: AsyncGenerator[str, None], tally: _Tally,
                      chunk: Callable[[], ChatCompletionChunk | CompletionChunk]) -> AsyncGenerator[str, None]:
    try:
        async with aclosing(body) as texts:  # closing the stream closes the engine iterators inside it
            async for text in texts:
                yield text
        if spec.include_usage:
            last = chunk()
            last.usage = usage(spec.prompt_tokens, sum(tally.done_tokens.values()), sum(tally.cached.values()))
            yield event(last)
    except Exception as exc:  # the 200 is out: all we can do is tell the client in-band
        yield error_event(exc)
    yield DONE


@dataclass(frozen=True)
class ToolStreaming:
    """Tool calls read out of a chat stream: text that may open a call is held back until it is decided."""

    parser: ToolParser
    parallel: bool  # False: calls after the first are dropped (parallel_tool_calls false)


@dataclass(frozen=True)
class ReasoningStreaming:
    """Reasoning read out of a chat stream (server/api/reasoning.py) before any tool parsing of the answer."""

    start: Start  # where the output starts, from the rendered prompt
    include: bool  # include_reasoning: False drops the reasoning deltas


def chat_events(spec: StreamSpec, outputs: TaggedOutputs, strings: TokenStrings,
                tools: ToolStreaming | None = None,
                reasoning: ReasoningStreaming | None = None) -> AsyncGenerator[str, None]:
    tally = _Tally()
    streams: dict[int, ToolStream] = {}
    calls: dict[int, int] = {}  # choice -> tool calls sent
    thinkers: dict[int, ReasoningParser] = {}

    def chunk(*choices: ChatStreamChoice) -> ChatCompletionChunk:
        # Every field passed explicitly: events are serialized with exclude_unset (see server/api/sse.py).
        c = ChatCompletionChunk(id=spec.request_id, object="chat.completion.chunk", created=spec.created,
                                model=spec.model, choices=list(choices))
        if spec.include_usage:
            # OpenAI sends "usage": null on every chunk but the last when usage is asked for
            c.usage = tally.current(spec) if spec.continuous_usage else None
        return c

    def split(index: int, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of new text of a choice."""
        assert reasoning is not None
        parser = thinkers.setdefault(index, ReasoningParser(reasoning.start))
        return parser.feed(text, last=final)

    frame = ChunkFrame(spec.request_id, "chat.completion.chunk", spec.created, spec.model, spec.include_usage)

    def tool_events(index: int, text: str, final: bool) -> tuple[str, list[str]]:
        """(content to send, tool-call chunks) for new text of a choice, through its tool parser."""
        assert tools is not None
        stream = streams.setdefault(index, tools.parser.stream())
        content, out = [], []
        for ev in (stream.feed(text) if text else []) + (stream.finish() if final else []):
            if isinstance(ev, str):
                content.append(ev)
            elif tools.parallel or not calls.get(index):
                k = calls[index] = calls.get(index, 0) + 1
                delta = ChatDelta(tool_calls=[ToolCallDelta(index=k - 1, id=ev.id, type="function",
                                                            function=FunctionCallDelta(name=ev.name,
                                                                                       arguments=ev.arguments))])
                out.append(event(chunk(ChatStreamChoice(index=index, delta=delta, logprobs=None,
                                                        finish_reason=None))))
        return "".join(content), out

    async def body() -> AsyncGenerator[str, None]:
        for i in range(spec.n):
            yield event(chunk(ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content=""),
                                               logprobs=None, finish_reason=None)))
        async with aclosing(outputs) as outs:
            async for prompt_idx, out in outs:
                tally.add(out.index, prompt_idx, out)
                final = out.finish_reason is not None
                text, call_chunks, thought = out.text, [], ""
                if reasoning is not None:
                    thought, text = split(out.index, text, final)
                    if thought and reasoning.include:
                        yield event(chunk(ChatStreamChoice(index=out.index, delta=ChatDelta(reasoning_content=thought),
                                                           logprobs=None, finish_reason=None)))
                if tools is not None:
                    text, call_chunks = tool_events(out.index, text, final)
                if not spec.logprobs and not spec.continuous_usage:
                    if text:
                        yield frame.chat_content(out.index, text)
                else:
                    lps = ChatLogprobs(content=chat_logprobs(strings, out.logprobs or ())) if spec.logprobs else None
                    if text or (lps is not None and lps.content):
                        yield event(chunk(ChatStreamChoice(index=out.index, delta=ChatDelta(content=text),
                                                           logprobs=lps, finish_reason=None)))
                for c in call_chunks:
                    yield c
                if out.finish_reason is not None:
                    reason = finish_reason(out.finish_reason, bool(calls.get(out.index)))
                    yield event(chunk(ChatStreamChoice(index=out.index, delta=ChatDelta(), logprobs=None,
                                                       finish_reason=reason, stop_reason=out.stop_reason)))

    return _with_usage(spec, body(), tally, chunk)


def completion_events(spec: StreamSpec, outputs: TaggedOutputs,
                      strings: TokenStrings, echo: list[tuple[str, list[int]]] | None) -> AsyncGenerator[str, None]:
    """`echo`, when set, holds each prompt's (text, ids): sent ahead of the choice's first output."""
    tally = _Tally()
    builders: dict[int, CompletionLogprobsBuilder] = {}
    started: set[int] = set()

    def chunk(*choices: CompletionChoice) -> CompletionChunk:
        c = CompletionChunk(id=spec.request_id, object="text_completion", created=spec.created, model=spec.model,
                            choices=list(choices))
        if spec.include_usage:
            c.usage = tally.current(spec) if spec.continuous_usage else None
        return c

    frame = ChunkFrame(spec.request_id, "text_completion", spec.created, spec.model, spec.include_usage)

    async def body() -> AsyncGenerator[str, None]:
        async with aclosing(outputs) as outs:
            async for prompt_idx, out in outs:
                index = prompt_idx * spec.n + out.index
                text, echoed = out.text, list[int]()
                if echo is not None and index not in started:
                    prompt_text, echoed = echo[prompt_idx]
                    text = prompt_text + text
                started.add(index)
                tally.add(index, prompt_idx, out)
                if not spec.logprobs and not spec.continuous_usage:
                    yield frame.completion(index, text, out.finish_reason, out.stop_reason)
                    continue
                if not spec.logprobs:
                    yield event(chunk(CompletionChoice(index=index, text=text, logprobs=None,
                                                       finish_reason=out.finish_reason, stop_reason=out.stop_reason)))
                    continue
                if index not in builders:
                    builders[index] = CompletionLogprobsBuilder(strings)
                lps = builders[index].add(out.logprobs or (), echoed)
                yield event(chunk(CompletionChoice(index=index, text=text, logprobs=lps,
                                                   finish_reason=out.finish_reason, stop_reason=out.stop_reason)))

    return _with_usage(spec, body(), tally, chunk)
