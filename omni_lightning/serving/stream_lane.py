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
Reserved SMs (``serve --lane_sms N``): a high priority orders blocks waiting for an SM, it does not free one,
so each of a lane decode's few hundred kernels still waits for a bulk block to retire (on an H100 a lane decode
took 2.4 ms alone and 6.8 ms beside a busy bulk decoder, ``scripts/serve/bench_lane.py``). With ``N`` > 0, while
the lane holds a stream the bulk decodes launch on a CUDA stream of a green context (CUDA 12.8+) of the device's
SMs less ``N``: those ``N`` are the lane's alone, the rest it shares at its priority. With no stream open the
bulk has every SM. Where torch or the driver has no green contexts, a warning says so and the lane goes on
without reserved SMs; on a CPU the option does nothing.
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


def green_stream(device: torch.device, sms: int) -> tuple[Any, torch.cuda.Stream]:
    """A green context of ``sms`` of ``device``'s SMs and a CUDA stream of it: its kernels run on those SMs
    only (keep the context while the stream is used). RuntimeError saying why where there is none. torch 2.14
    builds the context with keywords; 2.11's class is a factory (``create``) whose constructor raises TypeError."""
    try:
        from torch.cuda.green_contexts import GreenContext

        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            ctx = GreenContext(num_sms=sms, device_id=index)
        except TypeError:
            ctx = GreenContext.create(sms, index)
        return ctx, ctx.Stream()
    except Exception as err:  # torch, the driver or the CUDA bindings have none
        raise RuntimeError(f"no green context of {sms} SMs ({type(err).__name__}: {err})") from err


def lane_arguments(setting: bool | None, make: Callable[[], StreamingDecoder], sms: int = 0) -> dict[str, Any]:
    """``serve --stream_lane`` (``build_app(stream_lane=...)``) as ``DecodeLoop``'s arguments: null, a lane
    where its memory holds one, else a warning; true, a lane or the server does not start; false, none.
    ``sms``: ``--lane_sms``, the SMs kept from the bulk decodes while a stream is open (0: none)."""
    if setting is False and sms:
        raise ValueError(f"lane_sms={sms} keeps SMs for the stream lane, which stream_lane=False turns off")
    return {"stream_lane": make if setting is not False else None, "lane_required": setting is True, "lane_sms": sms}


class StreamLane:
    """The streams' decoder (``make()``: built by :meth:`build`, after the bulk decoder's warm-up), its
    decodes (``Decodes`` on the lane's CUDA stream) and its warm-up."""

    def __init__(
        self, make: Callable[[], StreamingDecoder], metrics: Any, fail: Callable, required: bool = True, sms: int = 0
    ) -> None:
        self.make, self.metrics, self.fail, self.required, self.sms = make, metrics, fail, required, sms
        self.decoder: StreamingDecoder | None = None
        self.decodes: Decodes | None = None
        self.stream: torch.cuda.Stream | None = None
        self.bulk_stream: torch.cuda.Stream | None = None  # the bulk's while a stream is open (``sms``)
        self._green: Any = None  # the green context of ``bulk_stream``, kept alive with it
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
            self._reserve(self.decoder.engine.device)
        return time.perf_counter() - start

    def _reserve(self, device: torch.device) -> None:
        """``bulk_stream``: a green context's of the device's SMs less ``sms`` (none asked: nothing)."""
        if not self.sms:
            return
        total = torch.cuda.get_device_properties(device).multi_processor_count
        if self.sms >= total:
            raise ValueError(f"--lane_sms {self.sms}: the device has {total} SMs; the bulk decodes need some left")
        try:
            self._green, self.bulk_stream = green_stream(device, total - self.sms)
        except RuntimeError as err:
            log.warning("serve: --lane_sms %d: the stream lane goes on without reserved SMs: %s", self.sms, err)

    @contextlib.contextmanager
    def bulk_side(self) -> Iterator[None]:
        """Entered around each bulk launch: while the lane holds a stream and SMs are reserved, the bulk's CUDA
        stream is the green context's, ordered after the current stream's work and before what follows it
        there (so its inputs and outputs are used in the order the loop launched them); else nothing."""
        if self.bulk_stream is None or self.decoder is None or not self.decoder.streams:
            yield
            return
        with self._on_bulk_stream():
            yield

    def check_bulk_side(self, bulk: StreamingDecoder, chunk: int) -> None:
        """Runs ``bulk``'s warm step of one stream of ``chunk`` frames (a CUDA graph replayed) on ``bulk_stream``:
        where the device refuses it, a warning and no reserved SMs, before any client's decode could fail."""
        if self.bulk_stream is None:
            return
        try:
            with self._on_bulk_stream():
                bulk.warmup(chunk_sizes=(chunk,), batch_sizes=(1,))
            self.bulk_stream.synchronize()
            total = torch.cuda.get_device_properties(self.bulk_stream.device).multi_processor_count
            log.info("serve: while a stream is open the bulk decodes run on %d of %d SMs", total - self.sms, total)
        except Exception as err:  # e.g. a graph captured in the device's context, refused in the green one
            log.warning("serve: --lane_sms %d: the bulk decodes could not run on the SMs left (%s: %s); the stream "
                        "lane goes on without reserved SMs", self.sms, type(err).__name__, err)  # fmt: skip
            self.bulk_stream = self._green = None

    @contextlib.contextmanager
    def _on_bulk_stream(self) -> Iterator[None]:
        here = torch.cuda.current_stream(self.bulk_stream.device)
        self.bulk_stream.wait_stream(here)
        try:
            with torch.cuda.stream(self.bulk_stream):
                yield
        finally:
            here.wait_stream(self.bulk_stream)

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
