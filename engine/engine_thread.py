"""Runs an EngineCore in one background thread; callers talk to it through a thread-safe inbox.

The thread blocks on the inbox when there is no work (no polling, no CPU burnt while idle). Outputs of a
step are handed to `deliver` in one call, so an asyncio consumer is woken once per step, not per token.

Only this thread touches the EngineCore's scheduler, KV manager and runner. Everyone else reads `info` (fixed once
the model is loaded) and `stats`, a fresh immutable EngineStats published after every step and every batch of
commands (and when a decode bucket finishes compiling), by swapping one reference (engine/stats.py).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.gc_freeze import freeze_more, load_then_freeze, thaw
from engine.outputs import RequestOutput
from engine.request import Request
from engine.stats import EngineInfo, EngineStats

log = logging.getLogger("ember.engine")

Deliver = Callable[[list[RequestOutput]], None]


@dataclass(frozen=True)
class _Submit:
    reqs: list[Request]


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _Refresh:
    """Publish the stats again (a decode bucket became ready while the engine was idle)."""


@dataclass(frozen=True)
class _Call:
    """Run `fn(core)` between two steps (the only thread that may touch the scheduler) and resolve `future`."""

    fn: Callable[[EngineCore], Any]
    future: Future[Any]


class EngineThread:
    def __init__(self, config: EngineConfig, deliver: Deliver, on_fatal: Callable[[BaseException], None],
                 on_bucket: Callable[[int, float], None] | None = None) -> None:
        self.config, self._deliver, self._on_fatal, self._on_bucket = config, deliver, on_fatal, on_bucket
        self._inbox: queue.SimpleQueue[_Submit | _Abort | _Stop | _Call | _Refresh] = queue.SimpleQueue()
        self.ready = threading.Event()
        self.core: EngineCore | None = None
        self.info: EngineInfo | None = None
        self.stats: EngineStats | None = None
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, reqs: list[Request]) -> None:
        self._inbox.put(_Submit(reqs))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def call(self, fn: Callable[[EngineCore], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._inbox.put(_Call(fn, future))
        return future

    def stop(self, timeout: float | None = None) -> None:
        self._inbox.put(_Stop())
        self._thread.join(timeout)
        if self.core is not None:  # a background compile stops after its current bucket
            self.core.runner.graphs.stop(0)
            self.core.close()
        thaw()

    @property
    def compiling(self) -> bool:
        """Decode buckets are still compiling in the background (torch cannot interrupt that mid-bucket)."""
        return self.core is not None and not self.core.runner.graphs.compile_finished.is_set()

    def _run(self) -> None:
        try:
            with load_then_freeze():  # (engine/gc_freeze.py: a full collection would rescan the model's objects)
                core = self.core = EngineCore(self.config, self._bucket_ready)
            self.info = EngineInfo.of(core)
            self.stats = EngineStats.of(core)
            self.ready.set()
            self._loop(self.core)
        except BaseException as exc:  # the engine is dead: every waiter must hear about it
            log.exception("engine thread failed")
            self._on_fatal(exc)

    def _bucket_ready(self, bucket: int, seconds: float) -> None:
        """From the compile thread (or this one, while loading): pass it on, and have the stats republished."""
        if self._on_bucket is not None:
            self._on_bucket(bucket, seconds)
        self._inbox.put(_Refresh())

    def _handle(self, core: EngineCore, cmd: _Submit | _Abort | _Stop | _Call | _Refresh) -> bool:
        if isinstance(cmd, _Stop):
            return False
        if isinstance(cmd, _Refresh):
            pass  # the loop publishes after every batch of commands
        elif isinstance(cmd, _Submit):
            core.add(cmd.reqs)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn(core)
                self._publish(core)
                cmd.future.set_result(result)
            except Exception as exc:  # the caller hears about it; the engine keeps serving
                cmd.future.set_exception(exc)
        else:
            outs = core.abort(cmd.request_id)
            if outs:
                self._publish(core)
                self._deliver(outs)
        return True

    def _loop(self, core: EngineCore) -> None:
        compiling = True  # until the background loads and compiles are done: then their objects are frozen too
        while True:
            if compiling and core.runner.graphs.compile_finished.is_set():
                compiling = False
                freeze_more()
            if not core.has_work() and not self._handle(core, self._inbox.get()):  # idle: block
                return
            while True:  # drain everything that arrived during the last step
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if not self._handle(core, cmd):
                    return
            if core.has_work():
                outs = core.step()
                self._publish(core)
                if outs:
                    self._deliver(outs)
            else:
                self._publish(core)

    def _publish(self, core: EngineCore) -> None:
        # Before outputs are delivered: a client that has seen its output sees the stats of that step.
        self.stats = EngineStats.of(core)
