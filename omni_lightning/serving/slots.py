"""``Slots``: who a decode loop serves: each client's :class:`Job` holding one of ``max_streams`` slots, or a
whole request waiting for one in a queue of at most ``max_queue``; what no slot or queue place gets
(:class:`Overloaded`), and how a job ends (its slot freed, the queue's first taking it, its sink told).

Thread-safe: fronts' threads (or the engine process's socket reader) add jobs and push chunks while the loop's
thread steps; ``_wake`` wakes the loop. The decoder side of a slot (a stream opened in a decoder) is the
loop's: :meth:`Slots._release` (``DecodeLoop``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from omni_lightning.serving.jobs import Job, Overloaded, Sink


class Slots:
    """The slots and the queue (see the module docstring); ``metrics``: a ``ServeMetrics`` or None."""

    def __init__(self, max_streams: int, max_queue: int, metrics: Any) -> None:
        self.max_streams, self.max_queue, self.metrics = max_streams, max_queue, metrics
        self.warmup_error: str | None = None
        self._lock, self._wake, self._stop = threading.Lock(), threading.Event(), False
        self._active: list[Job] = []  # holding a slot (or about to open one)
        self._waiting: deque[Job] = deque()  # whole requests waiting for a slot

    @property
    def open_jobs(self) -> int:
        """Clients holding a slot or waiting for one."""
        with self._lock:
            return len(self._active) + len(self._waiting)

    def open_stream(self, rid: str, sink: Sink) -> Job:
        """A stream in a free slot, or :class:`Overloaded`."""
        job = Job(rid, sink)
        self._check_running()
        with self._lock:
            if len(self._active) >= self.max_streams or self._waiting:
                raise Overloaded(f"all {self.max_streams} streams are in use (--max_streams): retry later")
            self._active.append(job)
        self._changed()
        return job

    def submit(self, rid: str, codes: torch.Tensor, sink: Sink) -> Job:
        """A whole request (checked codes ``[Q, n]``): decoded in a free slot, else queued, else :class:`Overloaded`."""
        job = Job(rid, sink, codes=codes, finishing=True)
        self._check_running()
        with self._lock:
            if len(self._active) < self.max_streams and not self._waiting:
                self._active.append(job)
            elif len(self._waiting) < self.max_queue:
                self._waiting.append(job)
            else:
                raise Overloaded(f"{self.max_streams} streams busy and {self.max_queue} requests queued: retry later")
        self._changed()
        return job

    def _check_running(self) -> None:
        if self.warmup_error or self._stop:
            why = f"its warm-up failed ({self.warmup_error})" if self.warmup_error else "it is stopping"
            raise Overloaded(f"the server cannot decode: {why}", retry_after=30)

    def push(self, job: Job, codes: torch.Tensor) -> None:
        job.chunks.append((time.perf_counter(), codes))
        self._wake.set()

    def finish(self, job: Job) -> None:
        job.finishing = True
        self._wake.set()

    def abort(self, job: Job) -> None:
        """The client is gone: its slot is freed at the next step (a queued request leaves the queue now)."""
        job.aborted = True
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
                job.done = True
        self._changed()

    def _changed(self) -> None:
        if self.metrics is not None:
            self.metrics.open_streams.set(len(self._active))
            self.metrics.queue_depth.set(len(self._waiting))
        self._wake.set()

    def _release(self, job: Job) -> None:
        """Frees what ``job`` holds in the decoder (the loop's)."""

    def _close(self, job: Job, message: tuple[str, Any] | None) -> None:
        """Frees the job's slot (decoding nothing more: what was pushed is decoded by the step already)."""
        self._release(job)
        with self._lock:
            if job in self._active:
                self._active.remove(job)
            while self._waiting and len(self._active) < self.max_streams:  # a freed slot goes to the queue first
                self._active.append(self._waiting.popleft())
        self._changed()
        self._end(job, message)

    def _end(self, job: Job, message: tuple[str, Any] | None) -> None:
        job.done = True
        if message is not None and not job.aborted:
            job.sink(*message)
