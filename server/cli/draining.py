"""The uvicorn server of `ember serve` with a graceful drain: the first SIGTERM / SIGINT turns /health and new
requests into 503 while running requests finish (server/api/app.py `start_drain`); a second one exits at once."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

log = logging.getLogger("ember.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._signalled = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def stop(self, code: int) -> None:
        """Ask the server to exit with `code` (event-loop thread only)."""
        self.exit_code = max(self.exit_code, code)
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a Python signal handler on the main (event loop) thread, between two bytecodes: do nothing
        # here but hand the work to the loop. Not recorded in _captured_signals, so uvicorn does not re-raise.
        if self._signalled or self._loop is None:
            log.warning("second signal: exiting now")
            self.exit_code, self.should_exit, self.force_exit = 1, True, True
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._begin_drain, sig)

    def _begin_drain(self, sig: int) -> None:
        from server.api.app import start_drain

        log.info("received %s", signal.Signals(sig).name)  # says which signal a drain answers

        self._drain = start_drain(self.app, lambda: self.stop(0))
        if self._drain is None:  # not started yet: nothing to drain
            self.stop(0)
