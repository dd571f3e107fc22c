"""The engine process: one per device, its :class:`DecodeLoop` stepping on its main thread, its clients the
front processes over a ZeroMQ ROUTER socket (``wire.py``: msgpack headers, raw code and audio buffers).

Nothing else runs here: no HTTP, no JSON, no encoding, so Python's work for the clients never holds the
GIL the decode loop needs. Between a step's launch and its copy back to the host the loop reads its socket
(``DecodeLoop.run_step``'s ``between``), so messages that came during the step go into the next one. With
no work it blocks on the socket. SIGTERM stops it after its current step (the supervisor sends it once the
fronts have drained); every job still open is told the server stopped.

Not done: several fronts' jobs are one queue (first come, first served, whichever front sent them); a job
of a front that died stays until it ends (its answers are dropped by ZeroMQ).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from omni_lightning.serving import wire
from omni_lightning.serving.decode_loop import DecodeLoop
from omni_lightning.serving.jobs import Job, Overloaded
from omni_lightning.serving.request_log import to_stderr
from omni_lightning.serving.supervisor import freeze_startup

log = logging.getLogger("omni_lightning.serving")


class EngineServer:
    """Serves ``loop`` on ``address`` (``ipc://...`` or ``tcp://127.0.0.1:...``) until :meth:`stop`."""

    def __init__(self, loop: DecodeLoop, address: str) -> None:
        self.loop, self.address = loop, address
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.bind(address)
        self.jobs: dict[tuple[bytes, int], Job] = {}
        self.stopping = False

    def stop(self, *_: Any) -> None:
        self.stopping = True

    def serve(self) -> None:
        """Steps the loop, reading the socket between steps and during them, until stopped."""
        loop = self.loop
        while not self.stopping:
            self.receive(0 if loop.has_work() else 100)
            loop.run_step(between=lambda: self.receive(0))
        loop.close_all()
        self.socket.close()
        self.context.term()

    def receive(self, timeout_ms: int) -> None:
        """Handles every message waiting (waits up to ``timeout_ms`` for the first)."""
        while self.socket.poll(timeout_ms):
            timeout_ms = 0
            ident, header, *payload = self.socket.recv_multipart(copy=True)
            op, key, frames, rid, sent = wire.unpack(header)
            if op == wire.PUSH and self.loop.metrics is not None:  # a stream chunk's hand-off from its front
                self.loop.metrics.stream_chunk_to_engine_seconds.observe(time.perf_counter() - sent)
            try:
                self._handle(ident, op, key, frames, rid, payload)
            except Overloaded as err:
                self._send(ident, key, "error", [503, str(err)])

    def _handle(self, ident: bytes, op: str, key: int, frames: int, rid: str, payload: list[bytes]) -> None:
        loop, jobs = self.loop, self.jobs
        if op == wire.SUBMIT:
            codes = wire.frame_codes(payload[0], frames)
            jobs[ident, key] = loop.submit(rid, codes, self._sink(ident, key))
        elif op == wire.OPEN:
            jobs[ident, key] = loop.open_stream(rid, self._sink(ident, key))
        elif (job := jobs.get((ident, key))) is None:
            return  # ended already (a push after an error, an abort after the end)
        elif op == wire.PUSH:
            loop.push(job, wire.frame_codes(payload[0], frames))
        elif op == wire.FINISH:
            loop.finish(job)
        elif op == wire.ABORT:
            loop.abort(job)
            if job.done:
                jobs.pop((ident, key), None)

    def _sink(self, ident: bytes, key: int) -> Callable[[str, Any], None]:
        def sink(kind: str, value: Any) -> None:
            if kind == "audio":
                sizes, buffers = wire.audio_frames(value)  # copied by ZeroMQ: the step's buffer is reused
                self.socket.send_multipart([ident, wire.pack("audio", key, sizes), *buffers])
                return
            self.jobs.pop((ident, key), None)
            self._send(ident, key, kind, list(value) if value is not None else None)

        return sink

    def _send(self, ident: bytes, key: int, kind: str, value: Any) -> None:
        self.socket.send_multipart([ident, wire.pack(kind, key, value)])


def run_engine(build: Callable[[], tuple[DecodeLoop, dict]], address: str, conn: Any) -> None:
    """An engine process's body: ``build()`` its loop (and what the fronts need to know of it, sent on
    ``conn`` once warm: ``("ready", info)``, else ``("failed", why)``), then serve until SIGTERM. Its log
    lines (the warm-up's time, its start-up objects frozen, failures) go to stderr, as the fronts' do."""
    to_stderr()
    try:
        loop, info = build()
    except BaseException as err:  # the supervisor says why and exits non-zero
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        raise
    server = EngineServer(loop, address)
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the fronts, which drain; then SIGTERM here
    with loop.context(), torch.no_grad():
        if not loop.warm():
            conn.send(("failed", loop.warmup_error))
            return
        freeze_startup("engine")
        conn.send(("ready", info))
        server.serve()
