"""What the routes share, built once in the app's lifespan: the engine client, settings, metrics, and the
bookkeeping of in-flight generations that a graceful shutdown (drain) needs.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.client import EngineClient
from engine.core import EngineCore
from server.api.loads import ThroughputMeter
from server.api.metrics import ServerMetrics
from server.api.settings import ServerSettings

log = logging.getLogger("ember.server")


@dataclass
class ServerState:
    engine: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    # One worker: tokenizing a long prompt or rendering a chat template stays off the event loop, and never
    # runs concurrently with itself (HF fast tokenizers are not safe for concurrent mutation).
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-tokenize"))
    # Grammar compiles (structured outputs, forced tool calls) get their own worker: a complex schema can take
    # 100 ms or more, which must delay neither tokenizing other prompts nor the decode batch.
    grammar_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-grammar"))
    throughput: ThroughputMeter = field(default_factory=ThroughputMeter)  # /v1/loads gen_throughput
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    # engine request id -> number of sequences (choices) it runs
    inflight: dict[str, int] = field(default_factory=dict)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def core(self) -> EngineCore:
        return self.engine.core

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or self.engine.info.model_config.name

    # ---- in-flight bookkeeping (event loop only) --------------------------------------------------------
    def begin(self, request_id: str, sequences: int) -> None:
        self.inflight[request_id] = sequences
        self._idle.clear()

    def end(self, request_id: str) -> None:
        self.inflight.pop(request_id, None)
        if not self.inflight:
            self._idle.set()

    async def drain(self, grace_seconds: float, on_done: Callable[[], None]) -> None:
        """Refuse new work, let running requests finish for up to `grace_seconds`, abort the rest, then stop.

        An abort makes the engine finish each sequence with reason `abort` within one step, so their responses
        complete normally (finish_reason "abort") instead of being cut off.
        """
        self.draining = True
        log.info("draining: %d requests in flight, grace period %.0f s", len(self.inflight), grace_seconds)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace_seconds)
        except TimeoutError:
            log.warning("grace period over: aborting %d requests", len(self.inflight))
            for request_id in list(self.inflight):
                self.engine.abort(request_id)
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=10.0)
            except TimeoutError:
                log.error("%d requests did not finish after abort", len(self.inflight))
        log.info("drained; shutting down")
        on_done()

    def shutdown(self) -> None:
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.grammar_pool.shutdown(wait=False, cancel_futures=True)
