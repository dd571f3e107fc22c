"""What a client's work is to a decode loop: :class:`Job` (a whole request or a stream), the ``Sink`` it is
answered through, :class:`Overloaded` (a 503), and ``queue_sink`` (answers onto an event loop's queue).
The same on both sides of the engine process's socket (``engine_process.py``, ``engine_client.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Sink = Callable[[str, Any], None]


class Overloaded(Exception):
    """No slot and no room in the queue: the client should retry after ``retry_after`` seconds (a 503)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    """One client's work: a whole request (``codes`` given) or a stream (chunks pushed as they come)."""

    rid: str
    sink: Sink
    codes: torch.Tensor | None = None  # a whole request's codes, pushed ``request_frames`` at a time
    chunks: deque = field(default_factory=deque)  # a stream's chunks not yet pushed, (when it came, codes) each
    pushed_at: list = field(default_factory=list)  # when the chunks of its decode in flight came
    finishing: bool = False  # no more chunks: close after the last is decoded
    aborted: bool = False  # the client went away: close now
    sid: int | None = None  # its stream in the decoder, once opened
    sent_frames: int = 0  # frames pushed so far
    created: float = field(default_factory=time.perf_counter)
    first_audio: float | None = None
    done: bool = False
    in_flight: int = 0  # decodes launched with its frames whose audio is not handed out yet
    key: int = 0  # its number in a front process (engine_client.py)
    engine: int = 0  # which engine process decodes it (engine_client.py)

    @property
    def is_stream(self) -> bool:
        return self.codes is None


def queue_sink(queue: asyncio.Queue) -> Sink:
    """A sink for a job made on an event loop's thread: each message goes onto ``queue`` on that loop.

    Called from another thread (a ``DecodeLoop``'s, one process: its audio is views of a host buffer its next
    step reuses) it copies the audio and hands the message over thread-safely, for the loop's next turn.
    Called on the loop's own thread (``RemoteLoop``'s reader, a front process: its audio is made from the
    message's bytes, the sink's to keep) it puts the message on the queue at once, no copy: the route's task
    wakes a turn of the event loop sooner, without a write to the loop's wake-up pipe."""
    loop, thread = asyncio.get_running_loop(), threading.get_ident()

    def sink(kind: str, value: Any) -> None:
        if threading.get_ident() == thread:
            queue.put_nowait((kind, value))
            return
        if kind == "audio":  # views of the decode loop's host buffer, which its next step reuses
            value = [piece.clone() for piece in value]
        with contextlib.suppress(RuntimeError):  # the event loop closed: nobody is waiting
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

    return sink
