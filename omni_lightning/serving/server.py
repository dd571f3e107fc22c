"""Running an app of ``build_app`` under uvicorn: one process, one event loop, one decode thread.

:class:`DrainingServer` is uvicorn's server with a drain on SIGTERM (and the first Ctrl-C): ``/health``
says ``draining`` and new requests and streams get 503, while every request and stream in flight is
answered to its end (uvicorn alone closes open WebSockets at once, with 1012); then uvicorn shuts down
as usual, and the signal is raised again for the caller (the command line exits 143). A second signal
stops at once. ``drain_timeout`` bounds the wait.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger("omni_lightning.serving")


class DrainingServer(uvicorn.Server):
    """uvicorn's ``Server``, draining on the first SIGTERM or SIGINT (see the module docstring).
    ``on_listen(host, port)`` is called once the socket is bound (``port`` 0 chooses a free one)."""

    def __init__(
        self, config: uvicorn.Config, drain_timeout: float = 30.0, on_listen: Callable[[str, int], None] | None = None
    ) -> None:
        super().__init__(config)
        self.drain_timeout, self.on_listen = drain_timeout, on_listen
        self.drain_started: float | None = None
        self.serving = config.app.state.serving  # the app's ServeState (app.py)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.on_listen is not None and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.on_listen(host, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self.serving
        if self.drain_started is not None or state is None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)  # a second signal: uvicorn's own (finish responses, then stop)
            return
        self._captured_signals.append(sig)  # raised again once uvicorn has shut down (as uvicorn does)
        self.start_drain()

    def start_drain(self) -> None:
        """Refuses new work from now on; the server stops once what is in flight is answered."""
        state = self.serving
        if state is not None and self.drain_started is None:
            state.draining, self.drain_started = True, time.monotonic()
            log.warning("serve: draining: %d requests and streams in flight, then exit", state.handlers)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            state = self.serving
            idle = state.handlers == 0 and state.loop.open_jobs == 0
            if idle or time.monotonic() - self.drain_started > self.drain_timeout:
                if not idle:
                    log.warning("serve: drain timed out after %.0f s: %d left", self.drain_timeout, state.handlers)
                self.should_exit = True
        return await super().on_tick(counter)


def request_log() -> logging.Logger:
    """The serving log on stderr, a line per request and stream with its id (once per process)."""
    log = logging.getLogger("omni_lightning.serving")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def server_for(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_timeout: float = 30.0,
    on_listen: Callable[[str, int], None] | None = None,
    max_message_bytes: int | None = None,
    log_level: str = "warning",
) -> DrainingServer:
    """A :class:`DrainingServer` for ``app`` (``.run()`` it, or ``await .serve()``); uvicorn's own access
    log is off (the app logs each request with its id)."""
    ws_max = max_message_bytes or app.state.serving.max_body_bytes
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        ws_max_size=ws_max + 1024,
        timeout_graceful_shutdown=drain_timeout,
    )
    return DrainingServer(config, drain_timeout, on_listen)
