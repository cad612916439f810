"""Running requests through the engine on behalf of a route: admission checks, metrics and the per-request log
line, merging the streams of several prompts, and aborting when the client goes away.

Abort path: every iterator here is closed deterministically (`aclosing`, task cancellation), and closing the
engine's `generate()` iterator early aborts the request in the engine, which frees its KV within one step.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from engine.client import QueueFullError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError
from server.api.errors import ClientDisconnected, unavailable
from server.api.state import ServerState

log = logging.getLogger("ember.requests")
T = TypeVar("T")
# Outputs of one or several engine requests, each tagged with its prompt's position (see `merge`).
TaggedOutputs = AsyncGenerator[tuple[int, RequestOutput], None]


def check_admission(state: ServerState, prompts: Sequence[list[int]], params: SamplingParams | None) -> None:
    """Everything that would make the engine refuse these prompts, checked before a response has started, so
    a streaming request gets a proper 400 / 503 instead of an error event after its 200. params None: the
    prompts are embedding inputs.

    Raises APIError (503) or SamplingParamsError (400 through its handler).
    """
    retry = state.settings.retry_after_seconds
    if state.draining:
        raise unavailable("the server is shutting down", retry)
    if not state.engine.ready:
        raise unavailable("the engine is still loading", retry)
    for ids in prompts:
        if params is None:
            state.core.validate_embedding(ids)
        else:
            state.engine.validate(ids, params)
    try:
        state.engine.check_capacity(len(prompts))
    except QueueFullError as exc:
        raise unavailable(f"{exc}; retry later", retry) from None


async def generate(state: ServerState, request_id: str, prompt_ids: list[int],
                   params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
    """`engine.generate` plus in-flight tracking (for drain), metrics and one log line when it ends. The prompt
    has passed `check_admission`, which validated it."""
    metrics = state.metrics
    state.begin(request_id, params.n)
    metrics.prompt_len.observe(len(prompt_ids))
    last_at: dict[int, float] = {}
    produced: dict[int, int] = {}  # choice -> tokens so far (a choice abandoned mid-way has no final output)
    finals: list[RequestOutput] = []
    rejected = False
    t0 = time.monotonic()
    first_at: float | None = None
    try:
        async with aclosing(state.engine.generate(request_id, prompt_ids, params, validated=True)) as outputs:
            async for out in outputs:
                now = time.monotonic()
                if out.token_ids:
                    if out.index in last_at:
                        metrics.observe_gap(now - last_at[out.index], len(out.token_ids))
                    last_at[out.index] = now
                    first_at = first_at or now
                produced[out.index] = out.completion_tokens
                if out.finish_reason is not None:
                    finals.append(out)
                    metrics.observe_finished(out)
                yield out
    except (SamplingParamsError, QueueFullError):
        rejected = True  # lost a race with check_admission; nothing ran
        raise
    finally:
        state.end(request_id)
        if not rejected:
            abandoned = params.n - len(finals)
            if abandoned:
                metrics.observe_abandoned(abandoned)
            _log_finished(request_id, len(prompt_ids), finals, sum(produced.values()), abandoned,
                          time.monotonic() - t0, None if first_at is None else first_at - t0)


def _log_finished(request_id: str, prompt_tokens: int, finals: list[RequestOutput], output_tokens: int,
                  abandoned: int, elapsed: float, first_seen: float | None) -> None:
    # The engine's timings when a choice finished; for a request whose client left, what the server saw.
    ttfts = [o.metrics["ttft"] for o in finals if "ttft" in o.metrics]
    if not ttfts and first_seen is not None:
        ttfts = [first_seen]
    e2e = max((o.metrics.get("e2e", 0.0) for o in finals), default=elapsed) or elapsed
    reasons = sorted({str(o.finish_reason) for o in finals} | ({"abort (client gone)"} if abandoned else set()))
    log.info("request %s finished: prompt_tokens=%d output_tokens=%d ttft=%s tokens/s=%.1f finish_reason=%s",
             request_id, prompt_tokens, output_tokens, f"{min(ttfts):.3f}s" if ttfts else "-",
             output_tokens / e2e if e2e > 0 else 0.0, ",".join(reasons))


@dataclass(frozen=True)
class _Failed:
    error: BaseException



async def merge(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several streams as they come, tagged with the stream's position. Closing the merge (or an
    error in one stream) closes every stream."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for first in only:
                yield 0, first
        return
    queue: asyncio.Queue[tuple[int, T | _Failed | None]] = asyncio.Queue()  # None: that stream ended

    async def pump(i: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream) as it:
                async for item in it:
                    queue.put_nowait((i, item))
        except Exception as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait((i, _Failed(exc)))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect (uvicorn sends it when the
    # connection drops); waiting on it costs nothing, unlike polling `request.is_disconnected()`.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
