"""Running an app of ``build_app`` under uvicorn: one process, one event loop, one decode thread.

:class:`DrainingServer` is uvicorn's server with a drain on SIGTERM (and the first Ctrl-C): ``/health``
says ``draining`` and new requests and streams get 503, while every request and stream in flight is
answered to its end (uvicorn alone closes open WebSockets at once, with 1012); then uvicorn shuts down and
``run()`` returns. ``drain_timeout`` is a hard limit: past it, or at a second signal, the clients still in
flight are cut off, each told so (a whole request a 503 ``{"error": ...}``, a WebSocket stream its error
message and close 1013, a streamed body ended short), and the server stops :data:`GRACE_S` seconds later at
most. ``stopped_by`` and ``cut_off`` say how it ended (the command line's last line and exit status).
A WebSocket message over the app's ``max_body_bytes`` closes its stream with 1009, the reason naming the limit.
Not done: cutting a decode step short (a cut-off waits for the step in progress).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger("omni_lightning.serving")
GRACE_S = 2.0  # after a cut-off, for the clients' error messages to go out before the connections close
SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}


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
        self.stopped_by: str | None = None  # "SIGTERM" or "Ctrl-C": the signal that started the drain
        self.cut_reason: str | None = None  # why the clients in flight were cut off (None: all answered)
        self.cut_off = 0  # requests and streams cut off
        self.cut_at: float | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.on_listen is not None and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.on_listen(host, port)

    async def serve(self, sockets: Any = None) -> None:
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(self._said_already)
        try:
            await super().serve(sockets)
        finally:
            uvicorn_log.removeFilter(self._said_already)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # (a signal handler: it only sets flags, which on_tick acts on; nothing is raised again after the stop)
        if self.serving is None or sig not in SIGNALS:
            super().handle_exit(sig, frame)
        elif self.drain_started is None:
            self.stopped_by = SIGNALS[sig]
            self.start_drain()
        elif self.cut_reason is None:
            self.cut_reason = f"stopped at once by a second {SIGNALS[sig]}"
        else:  # a third: no more waiting for anything
            self.should_exit = self.force_exit = True

    def start_drain(self) -> None:
        """Refuses new work from now on; the server stops once what is in flight is answered."""
        state = self.serving
        if state is not None and self.drain_started is None:
            state.draining, self.drain_started = True, time.monotonic()
            log.warning("serve: draining: %d requests and streams in flight, then exit", state.handlers)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            state, now = self.serving, time.monotonic()
            if state.handlers == 0 and state.loop.open_jobs == 0:
                self.should_exit = True
            elif self.cut_at is not None:
                self.should_exit = now - self.cut_at > GRACE_S  # the rest: uvicorn cancels them
            else:
                if now - self.drain_started > self.drain_timeout:
                    self.cut_reason = f"the drain timed out after {self.drain_timeout:g} s (--drain_timeout)"
                if self.cut_reason is not None:
                    self._cut(state)
        return await super().on_tick(counter)

    def _cut(self, state: Any) -> None:
        """Ends every client in flight now: the decode loop stops after its step and tells each one."""
        self.cut_at, self.cut_off = time.monotonic(), max(state.handlers, state.loop.open_jobs)
        log.warning("serve: %s: %d requests and streams in flight cut off", self.cut_reason, self.cut_off)
        threading.Thread(target=state.loop.stop, name="omni-serve-stop", daemon=True).start()

    def _said_already(self, record: logging.LogRecord) -> bool:
        """After a cut-off, uvicorn's lines about the tasks it cancels (a traceback each) are left out: the
        cut-off's own line said it."""
        return self.cut_at is None or not str(record.msg).startswith(("Exception in ASGI", "Cancel "))


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (port 0: a free one), not yet listening: bound before the model
    loads, so a port in use is said at once. UsageError naming the address when it cannot be bound."""
    from omni_lightning.errors import UsageError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as err:
        raise UsageError(f"--host {host}: not an address to listen on ({err.strerror or err})") from err
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn's own: a restart reuses the port)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise UsageError(
            f"--port {port}: cannot listen on {host}:{port} ({err.strerror or err}): give another --port, "
            "or 0 for a free one"
        ) from err
    return sock


def websocket_protocol(max_message_bytes: int) -> Any:
    """uvicorn's WebSocket protocol (websockets' sans-I/O one), closing a message over ``max_message_bytes``
    with 1009 and a reason naming that limit (the library's names a frame's size); ``"auto"`` where that
    protocol is not installed (its own reason then)."""
    try:
        from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
        from websockets.server import ServerProtocol
    except ImportError:
        return "auto"
    too_big = f"a message over the limit of {max_message_bytes} bytes (--max_body_bytes): send fewer frames"

    class NamedLimit(ServerProtocol):
        def fail(self, code: int, reason: str = "") -> None:
            super().fail(code, too_big if code == 1009 else reason)

    class Protocol(WebSocketsSansIOProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            conn = self.conn
            self.conn = NamedLimit(
                extensions=conn.available_extensions, max_size=conn.max_message_size, logger=conn.logger
            )

    return Protocol


def stop_summary(server: DrainingServer) -> dict[str, Any]:
    """How a stopped server ended, as data (a front process sends it to the supervisor): the signal that
    stopped it, why clients were cut off (None: none were), how many, how long the drain took."""
    took = time.monotonic() - (server.drain_started or time.monotonic())
    return {"by": server.stopped_by or "request", "cut_reason": server.cut_reason, "cut_off": server.cut_off,
            "drained_s": took}  # fmt: skip


def stop_line(*summaries: dict[str, Any]) -> tuple[int, str]:
    """The exit status and last line of a server of one or more processes (their :func:`stop_summary`): 0 and
    a ``serve:`` line when every client in flight was answered; 130 (Ctrl-C) or 143 (SIGTERM) and an
    ``error:`` line when some were cut off."""
    by = next((x["by"] for x in summaries if x["by"] != "request"), "request")
    reason = next((x["cut_reason"] for x in summaries if x["cut_reason"] is not None), None)
    if reason is not None:
        n = sum(x["cut_off"] for x in summaries)
        cut = f"{n} {'request or stream' if n == 1 else 'requests and streams'} in flight cut off, each told so"
        return (130 if by == "Ctrl-C" else 143), f"error: serve: {reason}: {cut}"
    took = max((x["drained_s"] for x in summaries), default=0.0)
    return 0, f"serve: stopped on {by}, every request and stream in flight answered (drained in {took:.1f} s)"


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
    log is off (the app logs each request with its id), and so is WebSocket compression (below).
    ``max_message_bytes``: a WebSocket message past it closes its stream (default: the app's
    ``max_body_bytes``)."""
    ws_max = max_message_bytes or app.state.serving.max_body_bytes
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        ws=websocket_protocol(ws_max),
        ws_max_size=ws_max,
        # no per-message deflate: float PCM shrinks by ~7 % for ~2 ms of zlib a 0.8 s chunk on the front's
        # event loop (every connection of that front waiting), plus the client's inflate; a talker's chunk
        # latency went from 8 to 17 ms with it (p50, docs/performance.md#serving)
        ws_per_message_deflate=False,
        timeout_graceful_shutdown=GRACE_S,  # the drain (on_tick) waits first
    )
    return DrainingServer(config, drain_timeout, on_listen)
