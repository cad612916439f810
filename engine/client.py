"""The server's handle on the engine: `generate()` is an async iterator of outputs; leaving it early aborts.

Bridge: the engine thread calls `_deliver` with one step's outputs; that schedules a single callback on the
event loop (`call_soon_threadsafe`) which fans them out to per-request asyncio queues. Nothing polls.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.engine_thread import EngineThread
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.stats import EngineInfo, EngineStats


class EngineDeadError(RuntimeError):
    pass


class QueueFullError(RuntimeError):
    pass


@dataclass(frozen=True)
class _Fatal:
    error: BaseException


class EngineClient:
    def __init__(self, config: EngineConfig, on_bucket: Callable[[int, float], None] | None = None) -> None:
        # One resolved config (dtype auto made concrete), the engine's own: the server reads this very object.
        config = self.config = config.resolved()
        self._queues: dict[str, asyncio.Queue[RequestOutput | _Fatal]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = EngineThread(config, self._deliver, self._fatal, on_bucket)
        self.error: BaseException | None = None
        self.failed: asyncio.Event | None = None  # set on the event loop when the engine thread dies

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start loading and compiling in the background; `ready` turns true when it can serve."""
        self._loop = asyncio.get_running_loop()
        self.failed = asyncio.Event()
        self._thread.start()

    async def wait_ready(self) -> None:
        assert self._loop is not None
        await self._loop.run_in_executor(None, self._thread.ready.wait)

    @property
    def ready(self) -> bool:
        return self._thread.ready.is_set() and self.error is None

    @property
    def core(self) -> EngineCore:
        if self._thread.core is None:
            raise EngineDeadError("the engine is not ready")
        return self._thread.core

    def shutdown(self, timeout: float = 10.0) -> None:
        self._thread.stop(timeout)

    @property
    def compiling(self) -> bool:
        return self._thread.compiling

    @property
    def num_active(self) -> int:
        return len(self._queues)

    @property
    def info(self) -> EngineInfo:
        """What the loaded engine is (fixed once ready)."""
        info = self._thread.info
        if info is None:
            raise EngineDeadError("the engine is not ready")
        return info

    @property
    def stats(self) -> EngineStats:
        """The engine's latest published snapshot (engine/stats.py): what the server reads about its state."""
        stats = self._thread.stats
        if stats is None:
            raise EngineDeadError("the engine is not ready")
        return stats

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise SamplingParamsError (GrammarError among them) if the engine would refuse this prompt."""
        self.core.validate(prompt_ids, params)

    def check_capacity(self, new_requests: int) -> None:
        """Raise QueueFullError unless `new_requests` more fit beside those in flight (everything beyond the running
        batch is queued). Counted on the event loop, so it is exact."""
        if len(self._queues) + new_requests > self.config.max_running_requests + self.config.max_queued_requests:
            raise QueueFullError(f"the queue is full ({self.config.max_queued_requests} waiting requests)")

    # ---- requests -------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       validated: bool = False) -> AsyncGenerator[RequestOutput, None]:
        """validated: the caller has run `validate` on these very arguments (the server's admission does)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error}")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        # Raises before anything is queued.
        reqs = self.core.make_requests(request_id, prompt_ids, params, validate=not validated)
        async for out in self._run(request_id, reqs):
            yield out

    async def embed(self, request_id: str, prompt_ids: list[int]) -> RequestOutput:
        """The prompt's pooled, normalised final hidden state (`.embedding`), computed as prefill-only work that
        shares the engine's steps with decoding requests. Raises SamplingParamsError for a bad or too long input."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error}")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        req = self.core.make_embedding_request(request_id, prompt_ids, self.info.pooling)
        final: RequestOutput | None = None
        async for out in self._run(request_id, [req]):
            final = out
        if final is None or final.embedding is None:  # aborted (a drain's grace period ran out)
            raise EngineDeadError("the embedding request was aborted")
        return final

    async def _run(self, request_id: str, reqs: list[Request]) -> AsyncGenerator[RequestOutput, None]:
        """Queue the sequences of one request and yield their outputs until every one has finished."""
        self.check_capacity(1)
        q: asyncio.Queue[RequestOutput | _Fatal] = asyncio.Queue()
        self._queues[request_id] = q
        self._thread.submit(reqs)
        remaining = len(reqs)
        try:
            while remaining:
                item = await q.get()
                if isinstance(item, _Fatal):
                    raise EngineDeadError(f"the engine failed: {item.error}")
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            del self._queues[request_id]
            if remaining:  # the caller left early (disconnect, cancel, error): free its KV now
                self._thread.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._thread.abort(request_id)

    async def flush_cache(self) -> int:
        """Evict every prefix-cache entry no running request uses (on the engine thread); returns slots freed (the
        stats published after it show what stays cached)."""
        return await asyncio.wrap_future(self._thread.call(lambda core: core.scheduler.flush_cache()))

    # ---- engine-thread side ---------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._fan_out, outputs)

    def _fan_out(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:  # absent: the caller already left
                q.put_nowait(out)

    def _fatal(self, error: BaseException) -> None:
        self.error = error
        self._thread.ready.set()  # unblock anyone waiting for readiness; `ready` stays false
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fan_out_fatal, error)

    def _fan_out_fatal(self, error: BaseException) -> None:
        if self.failed is not None:
            self.failed.set()
        for q in self._queues.values():
            q.put_nowait(_Fatal(error))
