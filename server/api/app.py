"""The FastAPI application: routers, error handlers, auth, body limit, and a lifespan that owns the engine.

The engine starts loading (and compiling) in the background when the lifespan starts, so the server listens
at once and /health says 503 until the engine is ready; a failed load asks the server to exit with code 1.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from engine.client import EngineClient
from engine.config import EngineConfig
from server.api import (
    routes_anthropic,
    routes_chat,
    routes_embeddings,
    routes_native,
    routes_openai,
    routes_ops,
    routes_responses,
)
from server.api.auth import require_api_key
from server.api.errors import install_error_handlers
from server.api.http_metrics import HTTPMetricsMiddleware
from server.api.limits import BodySizeLimitMiddleware
from server.api.metrics import ServerMetrics
from server.api.settings import ServerSettings
from server.api.state import ServerState

log = logging.getLogger("ember.server")
ExitHook = Callable[[int], None]


@asynccontextmanager
async def engine_lifetime(config: EngineConfig) -> AsyncIterator[EngineClient]:
    """The engine client from start (loading in its thread) to a stopped engine thread."""
    engine = EngineClient(config)
    engine.start()
    try:
        yield engine
    finally:
        # A still-loading engine thread (a daemon) cannot stop mid-compile: don't wait for it at exit.
        await asyncio.to_thread(engine.shutdown, 10.0 if engine.ready else 0.0)


async def _wait_ready(engine: EngineClient) -> None:
    """Until the engine is ready or failed. Not `EngineClient.wait_ready()`: that parks a default-executor
    thread on a threading.Event, and asyncio.run joins that thread at exit, so a SIGTERM during a long
    compile would wait for the whole compile. A 10 Hz check during start-up only costs nothing."""
    while not engine.ready and engine.error is None:
        await asyncio.sleep(0.1)


async def _announce_ready(state: ServerState, on_exit: ExitHook) -> None:
    started = time.monotonic()
    await _wait_ready(state.engine)
    if state.engine.error is not None:
        log.error("the engine failed to start: %s", state.engine.error)
        on_exit(1)
        return
    info = state.engine.info
    host = "127.0.0.1" if state.settings.host in ("0.0.0.0", "::", "") else state.settings.host
    log.info("ready in %.1f s: serving %s at http://%s:%d/v1 (max context %d, KV pool %d tokens, max %d running "
             "requests)", time.monotonic() - started, state.model_name, host, state.settings.port,
             info.max_context, info.kv_slots, info.max_running_requests)
    # A dead engine thread cannot come back: exit non-zero so a supervisor (docker, systemd) restarts us.
    assert state.engine.failed is not None
    await state.engine.failed.wait()
    log.error("the engine failed while serving: %s", state.engine.error)
    on_exit(1)


def create_app(config: EngineConfig, settings: ServerSettings, on_exit: ExitHook | None = None) -> FastAPI:
    """`on_exit(code)` is how the app asks its server to stop (engine failure, end of a drain)."""
    exit_hook: ExitHook = on_exit or (lambda code: None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine_lifetime(config) as engine:
            state = ServerState(engine, settings, ServerMetrics(lambda: (engine.info, engine.stats) if engine.ready else None,
                                                                settings.metrics_compat))
            app.state.server = state
            ready_task = asyncio.create_task(_announce_ready(state, exit_hook))
            try:
                yield
            finally:
                ready_task.cancel()
                state.shutdown()

    app = FastAPI(title="Ember", lifespan=lifespan, dependencies=[Depends(require_api_key)],
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(HTTPMetricsMiddleware)  # outermost: it sees the status of every answer, 413s included
    app.include_router(routes_ops.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_chat.router)
    app.include_router(routes_anthropic.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_native.router)
    app.include_router(routes_embeddings.router)
    return app


def start_drain(app: FastAPI, on_done: Callable[[], None]) -> asyncio.Task[None] | None:
    """SIGTERM: begin a graceful drain (see ServerState.drain); None when the app has not started yet."""
    state: ServerState | None = getattr(app.state, "server", None)
    if state is None:
        return None
    return asyncio.create_task(state.drain(state.settings.shutdown_grace_seconds, on_done))
