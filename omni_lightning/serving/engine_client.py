"""``RemoteLoop``: a front process's view of the engine processes, with the calls of a :class:`DecodeLoop`
(``submit``, ``open_stream``, ``push``, ``finish``, ``abort``), so the app's routes are the same in one
process and in many. Each call sends a message (``wire.py``) over a ZeroMQ DEALER socket per engine; a
task on the front's event loop reads the answers and hands them to each job's sink.

A job goes to the engine with the fewest of this front's jobs open; a stream stays on its engine. Slots
and the queue are the engine's: a job it cannot take is answered ``("error", (503, ...))``, so a stream
past ``--max_streams`` is refused after its handshake (close 1013), not before it as in one process.
Not done: balancing on the other fronts' load (each front counts only its own jobs).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from typing import Any

import torch
import zmq
import zmq.asyncio

from omni_lightning.models.config import Code2WavConfig
from omni_lightning.serving import wire
from omni_lightning.serving.jobs import Job, Overloaded, Sink

log = logging.getLogger("omni_lightning.serving")


class RemoteLoop:
    """The engines at ``addresses``, each with ``max_streams`` slots, decoding a model of ``config``; ``metrics``
    (the front's ``ServeMetrics``): where a stream's audio's hand-off from its engine is timed."""

    def __init__(self, addresses: list[str], config: Code2WavConfig, max_streams: int, metrics: Any = None) -> None:
        self.addresses, self.config, self.max_streams = addresses, config, max_streams * len(addresses)
        self.metrics = metrics
        self.ready, self.warmup_error = threading.Event(), None  # the supervisor starts fronts once engines are warm
        self.jobs: dict[int, Job] = {}
        self.keys = itertools.count(1)
        self.sockets: list[Any] = []
        self._readers: list[asyncio.Task] = []
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def open_jobs(self) -> int:
        return len(self.jobs)

    def start(self) -> None:
        """Connects to the engines; call on the front's event loop."""
        context = zmq.asyncio.Context.instance()
        for address in self.addresses:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.sockets.append(sock)
        self._loop = loop = asyncio.get_running_loop()
        self._readers = [loop.create_task(self._read(sock)) for sock in self.sockets]
        self.ready.set()

    def stop(self) -> None:
        """Disconnects (any thread); jobs still open are told the server stopped."""
        self._stopping = True
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile
                self._loop.call_soon_threadsafe(self._close)

    def _close(self) -> None:
        for reader in self._readers:
            reader.cancel()
        for sock in self.sockets:
            sock.close()
        for job in list(self.jobs.values()):
            self._answer(job, "error", (503, f"request {job.rid}: the server stopped before all of it was decoded"))

    def submit(self, rid: str, codes: torch.Tensor, sink: Sink) -> Job:
        job = self._job(Job(rid, sink, codes=codes, finishing=True))
        self._send(job, wire.SUBMIT, codes)
        return job

    def open_stream(self, rid: str, sink: Sink) -> Job:
        job = self._job(Job(rid, sink))
        self._send(job, wire.OPEN)
        return job

    def push(self, job: Job, codes: torch.Tensor) -> None:
        self._send(job, wire.PUSH, codes)

    def finish(self, job: Job) -> None:
        job.finishing = True
        self._send(job, wire.FINISH)

    def abort(self, job: Job) -> None:
        job.aborted = True
        if self.jobs.pop(job.key, None) is not None:
            self._send(job, wire.ABORT)
        job.done = True

    def _job(self, job: Job) -> Job:
        if self._stopping:
            raise Overloaded("the server is stopping", retry_after=5)
        load = [0] * len(self.sockets)
        for other in self.jobs.values():
            load[other.engine] += 1
        job.key, job.engine = next(self.keys), load.index(min(load))
        self.jobs[job.key] = job
        return job

    def _send(self, job: Job, op: str, codes: torch.Tensor | None = None) -> None:
        frames = [wire.pack(op, job.key, 0 if codes is None else codes.shape[1], job.rid)]
        if codes is not None:
            frames.append(wire.codes_frame(codes))
        self.sockets[job.engine].send_multipart(frames)  # small: a copy is cheaper than a zero-copy frame

    async def _read(self, sock: Any) -> None:
        while True:
            header, *buffers = await sock.recv_multipart()
            kind, key, value, sent = wire.unpack(header)
            job = self.jobs.get(key)
            if job is None:
                continue  # aborted here already
            try:
                if kind == "audio":
                    if job.is_stream and self.metrics is not None:
                        self.metrics.stream_audio_to_front_seconds.observe(time.perf_counter() - sent)
                    job.sink("audio", [wire.frame_audio(b) for b in buffers])
                else:
                    self._answer(job, kind, tuple(value) if value is not None else None)
            except Exception:  # a sink's failure is its route's, not the reader's
                log.exception("serve: answering %s failed", job.rid)

    def _answer(self, job: Job, kind: str, value: Any) -> None:
        """The job's last message: it is done from now on."""
        self.jobs.pop(job.key, None)
        job.done = True
        job.sink(kind, value)
