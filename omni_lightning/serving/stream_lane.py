"""A stream lane: the WebSocket streams decoded by a decoder of their own, on a high-priority CUDA stream, so a
talker's chunk does not queue on the device behind the bulk decode in flight (``serve --stream_lane``).

Without a lane, the streams' chunks and the whole requests' slices are decodes of one ``StreamingDecoder``,
run one after the other on one CUDA stream: a chunk that comes while a bulk slice computes waits for it, and
for the slice the pipelined loop queued behind it. With a lane:

- the streams hold slots of a second ``StreamingDecoder`` over the same weights, with its own state, CUDA
  graphs, graph pool and capture stream (so its own cuBLAS workspace: two graphs replayed at once must not
  share one). Every client's audio is still ``decode`` of its codes alone: the two share only the weights,
  which nothing writes while serving;
- its decodes are launched on a CUDA stream of the greatest priority: the device schedules their blocks
  ahead of the bulk kernels' next ones, so a chunk computes beside the bulk slice, not after it;
- the decode loop launches a chunk as it comes, also while it waits for a bulk slice to land (it polls the
  slice's copy and its socket: ``DecodeLoop``), and on CUDA whole requests are not capped to a slice while streams
  are open (``schedule.py``'s cap bounds a chunk's wait behind bulk work, which a lane removes).

Memory: the lane's decoder is built after the bulk decoder's warm-up, so under a cap
(``gpu_memory_utilization``) its budget is what the bulk decoder left; with too little left it raises
``torch.OutOfMemoryError`` with the figures: asked for (``--stream_lane true``), the server does not start;
by default (``--stream_lane null``: a lane where its memory holds) it is dropped, a warning says why, and the
streams share the bulk decoder. Without a cap it takes the default budget, as the bulk decoder does. On a CPU
a lane has no stream of its own: its decodes run in turn with the bulk ones, which stay capped to a slice (the
same logic, no overlap: how the tests run it; there too it cut the talkers' waits beside bulk clients,
``docs/serving.md``).
Not done: a lane per priority class (all streams share one), preempting a bulk kernel already running
(the device finishes the blocks it started).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from omni_lightning.engine.streaming import StreamingDecoder
from omni_lightning.serving.decodes import Decodes

log = logging.getLogger("omni_lightning.serving")


def lane_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A CUDA stream of the greatest priority on ``device`` (None on a CPU: one device queue)."""
    if device.type != "cuda":
        return None
    _, greatest = torch.cuda.Stream.priority_range()  # (least, greatest): a lower number is a higher priority
    return torch.cuda.Stream(device, priority=greatest)


def lane_arguments(setting: bool | None, make: Callable[[], StreamingDecoder]) -> dict[str, Any]:
    """``serve --stream_lane`` (``build_app(stream_lane=...)``) as ``DecodeLoop``'s arguments: null, a lane
    where its memory holds one, else a warning; true, a lane or the server does not start; false, none."""
    return {"stream_lane": make if setting is not False else None, "lane_required": setting is True}


class StreamLane:
    """The streams' decoder (``make()``: built by :meth:`build`, after the bulk decoder's warm-up), its
    decodes (``Decodes`` on the lane's CUDA stream) and its warm-up."""

    def __init__(
        self, make: Callable[[], StreamingDecoder], metrics: Any, fail: Callable, required: bool = True
    ) -> None:
        self.make, self.metrics, self.fail, self.required = make, metrics, fail, required
        self.decoder: StreamingDecoder | None = None
        self.decodes: Decodes | None = None
        self.stream: torch.cuda.Stream | None = None
        self.inside = 0
        self.overlaps = False  # whether its decodes run beside the bulk's (a CUDA stream of its own: build)

    def build(self, chunk_sizes: tuple[int, ...], batch_sizes: tuple[int, ...]) -> float | None:
        """Makes the decoder and runs its warm-up on the lane's stream; returns its seconds. Out of memory: raises
        if ``required``, else frees what it made, warns, and returns None (no lane: the caller drops it)."""
        try:
            return self._build(chunk_sizes, batch_sizes)
        except torch.OutOfMemoryError as err:
            if self.required:
                raise
            self.decoder = self.decodes = self.stream = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            log.warning("serve: no stream lane, the streams share the bulk decoder: its memory did not hold one "
                        "(%s); --stream_lane false skips the attempt, true makes this an error", err)  # fmt: skip
            return None

    def _build(self, chunk_sizes: tuple[int, ...], batch_sizes: tuple[int, ...]) -> float:
        start = time.perf_counter()
        self.decoder = self.make()
        self.stream = lane_stream(self.decoder.engine.device)
        self.overlaps = self.stream is not None
        if self.stream is not None:  # the decoder's state was made on the current stream: the lane reads it after
            self.stream.wait_stream(torch.cuda.current_stream(self.decoder.engine.device))
        self.decodes = Decodes(self.decoder, self.metrics, self.fail, self.on_stream)
        if chunk_sizes:
            with self.on_stream():
                self.decoder.warmup(chunk_sizes=chunk_sizes, batch_sizes=batch_sizes)
        if self.stream is not None:
            self.stream.synchronize()
        return time.perf_counter() - start

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """The lane's stream current: every call of the lane's decoder that may launch device work (a decode,
        opening, pushing, closing a stream: a slot's state is zeroed) runs inside, so that it is ordered with
        the lane's decodes, not queued behind the bulk's on another stream. ``inside``: how deep (the CPU's
        stand-in for which stream is current)."""
        self.inside += 1
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                yield
        finally:
            self.inside -= 1
