"""``WriteQueue``: work handed to one background thread, in order, behind a bounded queue.

The predict loop puts a batch's work and returns at once; it waits only when ``max_pending`` items are
already queued (the time it waited is ``waited_s``). The first exception the worker raises is kept and
raised again, as a :class:`BackgroundWriteError` whose cause it is, by the next ``put``, ``drain`` or
``close``; items queued after it are dropped, never run out of order. Nothing blocks forever: every
wait polls the worker's state, so a worker that died cannot hang the loop.

What it does not do: run items in parallel (the handler may, inside one item: the writer encodes a
batch's files on a thread pool) or retry a failed item.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_STOP = object()
_POLL_S = 0.05


class BackgroundWriteError(RuntimeError):
    """The background worker failed; the worker's own exception is the cause."""


class WriteQueue:
    """Runs ``handle(item)`` for each put item on one daemon thread, in order (see the module docstring)."""

    def __init__(self, handle: Callable[[Any], None], max_pending: int = 4, name: str = "omni-lightning-writer"):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._handle = handle
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._closed = False
        self._dropping = False  # closed without draining: queued items are not handled
        self.waited_s = 0.0  # time put() blocked on a full queue
        self.busy_s = 0.0  # time the worker spent in handle()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if self._error is None and not self._dropping:
                    start = time.perf_counter()
                    self._handle(item)
                    self.busy_s += time.perf_counter() - start
            except BaseException as err:  # kept for the caller's thread; later items are dropped
                self._error = err
            finally:
                self._queue.task_done()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error = self._error
            raise BackgroundWriteError(f"the background writer failed: {type(error).__name__}: {error}") from error

    def put(self, item: Any) -> None:
        """Queues ``item``; blocks while the queue is full. Raises the worker's error, if any."""
        if self._closed:
            raise RuntimeError("this WriteQueue is closed")
        self._raise_if_failed()
        start = time.perf_counter()
        while True:
            try:
                self._queue.put(item, timeout=_POLL_S)
                break
            except queue.Full:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise BackgroundWriteError("the background writer stopped") from None
        self.waited_s += time.perf_counter() - start

    def drain(self) -> None:
        """Returns once every queued item was handled; raises the worker's error, if any."""
        while self._queue.unfinished_tasks and self._thread.is_alive():
            time.sleep(_POLL_S / 10)
        self._raise_if_failed()

    def close(self, drain: bool = True) -> None:
        """Stops the worker: after the queued items (``drain``) or at once, dropping them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._dropping = not drain
        while self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=_POLL_S)
                break
            except queue.Full:
                continue
        self._thread.join()
        if drain:
            self._raise_if_failed()

    @property
    def pending(self) -> int:
        """Items queued or being handled."""
        return self._queue.unfinished_tasks
