"""``DecodeLoop``: the one owner of a server's :class:`StreamingDecoder` and its decode steps.

Every client is a stream of that decoder: a WebSocket stream pushes its chunks as they come, a whole
request up to ``request_frames`` a step. Each step pushes what the schedule takes (``schedule.py``: stream
chunks first; whole requests capped to a slice of engine time while a stream is open) in two decodes: the
streams' chunks alone first, then the whole requests' frames (a chunk never waits for bulk rows in its own
forward); each decode advances its streams at once (``StreamingDecoder.step``), copies its audio to the host
in one copy and hands each client its audio, a stream's split per chunk (``decodes.py``). So every client gets
exactly ``decode`` of its codes, whatever else was in the step. Steps follow each other at once while work
remains; the loop sleeps only when idle. With ``pipeline`` (CUDA), a step's bulk decode is handed out in the
next step, after that step's first launch (the streams' chunks, else the next bulk slice), so the device need
not wait for the host between them. With a ``stream_lane`` (``stream_lane.py``) the streams are a second
decoder's, on a high-priority CUDA stream: their chunks are launched as they come, also while the loop waits
for a bulk slice to land, and on CUDA the bulk is not capped to a slice.

Slots are the decoder's ``max_streams`` (``slots.py``): a stream takes one when it opens (none free:
``Overloaded``), a whole request when one frees, waiting in a queue of at most ``max_queue``. A client that
goes away is closed at the next step. A step whose forward raises fails its clients (each told why) and no
other. Callers talk to the loop through :class:`Job` (``push``, ``finish``, ``abort``); it answers through the
job's ``sink`` on the loop's thread: ``("audio", [samples, ...])`` (views the next step reuses: a sink that
keeps them copies them), ``("end", None)`` or ``("error", (status, message))``. The loop runs on a thread of
its own (``start``: one process) or its caller's (``warm``, then ``run_step``: the engine process, which reads
its socket while the device computes, ``between``). Not done: a deadline per request (a client that wants one
closes its connection, which frees the slot).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from omni_lightning.engine.streaming import StreamingDecoder
from omni_lightning.serving.decodes import Decode, Decodes
from omni_lightning.serving.jobs import Job
from omni_lightning.serving.schedule import bulk_frames
from omni_lightning.serving.slots import Slots
from omni_lightning.serving.stream_lane import StreamLane

log = logging.getLogger("omni_lightning.serving")


class DecodeLoop(Slots):
    """Runs the decode steps (see the module docstring). ``context``: a context manager factory entered
    where the steps run (autocast for mixed precision); ``metrics``: a :class:`ServeMetrics` or None;
    ``warmup``: chunk sizes run before ``ready`` is set, at each of ``warmup_rows`` streams at once (the shapes
    steps take, captured before the first client, not in its way); ``bulk_slice_s``: while a stream is open,
    the engine time a step gives whole requests (``schedule.py``); ``pipeline`` (None: on CUDA): a step
    launches its decodes before handing out the last step's bulk audio (so the device need not wait for the
    host between them); ``stream_lane``: makes the streams' own decoder (``stream_lane.py``), None: no lane;
    ``lane_required``: False, a lane whose memory does not hold is dropped with a warning, not an error;
    ``lane_sms``: the SMs the bulk decodes leave to the lane while a stream is open (``stream_lane.py``)."""

    def __init__(
        self,
        decoder: StreamingDecoder,
        max_queue: int = 256,
        request_frames: int = 32,
        context: Callable[[], Any] = contextlib.nullcontext,
        metrics: Any = None,
        warmup: tuple[int, ...] = (1, 8),
        bulk_slice_s: float = 0.01,
        warmup_rows: tuple[int, ...] = (1,),
        pipeline: bool | None = None,
        stream_lane: Callable[[], StreamingDecoder] | None = None,
        lane_required: bool = True,
        lane_sms: int = 0,
    ) -> None:
        super().__init__(decoder.max_streams, max_queue, metrics)
        self.decoder, self.request_frames, self.context, self.warmup = decoder, request_frames, context, warmup
        self.config, self.bulk_slice_s = decoder.config, bulk_slice_s
        self.warmup_rows = tuple(r for r in warmup_rows if r <= self.max_streams) or (1,)
        self.decodes = Decodes(decoder, metrics, self._fail, self._bulk_side)
        self.lane = StreamLane(stream_lane, metrics, self._fail, lane_required, lane_sms) if stream_lane else None
        self.pipeline = decoder.engine.device.type == "cuda" if pipeline is None else pipeline
        self._in_flight: Decode | None = None  # a bulk decode launched, its audio not yet handed out
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-decode-loop", daemon=True)

    # --- any thread -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the thread after its current step; clients still open are told the server stopped."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- where the steps run --------------------------------------------------------------------

    def warm(self) -> bool:
        """Runs the warm-up; sets ``ready``, or ``warmup_error`` and returns False."""
        try:
            if self.warmup:
                seconds = self.decoder.warmup(chunk_sizes=self.warmup, batch_sizes=self.warmup_rows)
                log.info("serve: warm-up (chunks of %s frames, %s streams) took %.2f s", self.warmup,
                         self.warmup_rows, seconds)  # fmt: skip
            if self.lane is not None:
                if (seconds := self.lane.build(self.warmup, self.warmup_rows)) is None:
                    self.lane = None  # its memory did not hold one (the lane warned)
                else:
                    log.info("serve: the stream lane's decoder built and warmed up in %.2f s", seconds)
                    self.lane.check_bulk_side(self.decoder, min(self.warmup or (1,)))
        except Exception as err:  # the server answers /health 503 with this
            self.warmup_error = f"{type(err).__name__}: {err}"
            log.exception("serve: warm-up failed")
            return False
        self.ready.set()
        return True

    def has_work(self) -> bool:
        """Whether a step now would do something (else the caller may sleep until ``push``/``submit``)."""
        with self._lock:
            jobs = list(self._active)
        return self._in_flight is not None or any(
            j.aborted or j.chunks or (j.finishing and not j.done) or j.sid is None or self._has_more(j) for j in jobs
        )

    def run_step(self, between: Callable[[], None] | None = None) -> None:
        """One step; a failure in it is told to its clients, not raised. ``between`` runs while the
        device computes the step (after its launch, before its audio is copied back)."""
        try:
            self._step(between)
        except Exception as err:  # a bug: the clients in flight are told, the loop goes on
            log.exception("serve: the decode loop failed a step")
            for job in list(self._active):
                with contextlib.suppress(Exception):
                    self._close(job, ("error", (500, f"request {job.rid}: the server failed ({err!r})")))

    def close_all(self) -> None:
        """Tells every client left that the server stopped before its audio was decoded (a decode in flight
        is handed out first)."""
        if self._in_flight is not None:
            self.decodes.land(self._in_flight, None)
            self._in_flight = None
        with self._lock:
            left = self._active + list(self._waiting)
            self._active, self._waiting = [], deque()
        for job in left:
            self._end(job, ("error", (503, f"request {job.rid}: the server stopped before all of it was decoded")))

    def _run(self) -> None:
        with self.context(), torch.no_grad():
            if not self.warm():
                return
            while not self._stop:
                if not self.has_work():
                    self._wake.wait(0.5)
                self._wake.clear()
                self.run_step()
            self.close_all()

    def _step(self, between: Callable[[], None] | None = None) -> None:
        with self._lock:
            jobs = list(self._active)
        for job in jobs:
            if job.aborted:
                self._close(job, None)
        jobs = [j for j in jobs if not j.aborted]
        streams, bulk = [j for j in jobs if j.is_stream], [j for j in jobs if not j.is_stream]
        takes = bulk_frames([j.codes.shape[1] - j.sent_frames for j in bulk], self.request_frames,
                            bool(streams) and not self._overlapped, self.decodes.cost, self.bulk_slice_s)  # fmt: skip
        if self.lane is not None:
            self._lanes_step(bulk, takes, between)
            self._close_ended(jobs)
            return
        # the streams' chunks and the bulk slice are two decodes: a chunk never waits for bulk rows in its own
        phases = [[(j, None) for j in streams], list(zip(bulk, takes))]
        landing, self._in_flight = self._in_flight, None  # handed out after the next launch: the device goes on
        for phase in (p for p in phases if p):
            if not (pushed := self._push_all(phase)):
                continue
            is_bulk = phase[0][1] is not None
            launched = self.decodes.launch(pushed, is_bulk)
            if landing is not None:
                self.decodes.land(landing, between)
                landing = None
            if launched is not None and is_bulk and self.pipeline:  # the next step's decodes queue behind it
                self._in_flight = launched
            elif launched is not None:
                self.decodes.land(launched, between)
        if landing is not None:
            self.decodes.land(landing, between)
        elif between is not None and self._in_flight is None:
            between()  # nothing decoded: the socket is read all the same
        self._close_ended(jobs)

    def _lanes_step(self, bulk: list[Job], takes: list[int], between: Callable[[], None] | None) -> None:
        """With a stream lane: the streams' chunks at once, the next bulk slice launched, the last one landed
        (pipelined: the one before it), any chunk that comes while it computes launched on the lane meanwhile."""
        self._talk()
        pushed = self._push_all(list(zip(bulk, takes)))
        launched = self.decodes.launch(pushed, True) if pushed else None
        landing, self._in_flight = (self._in_flight, launched) if self.pipeline else (launched, None)
        if landing is None:
            if between is not None and self._in_flight is None:
                between()  # nothing decoded: the socket is read all the same
            return
        while not landing.copy.ready():  # the device computes the slice: chunks that come go on the lane
            if between is not None:
                between()
                time.sleep(5e-5)
            else:
                self._wake.wait(5e-4)
                self._wake.clear()
            self._talk()
        self.decodes.land(landing, None)

    def _talk(self) -> None:
        """The streams' chunks waiting, on the stream lane: launched and landed (their own decode only)."""
        with self._lock:
            streams = [j for j in self._active if j.is_stream and not j.aborted and not j.done]
        pushed = self._push_all([(j, None) for j in streams]) if any(j.chunks for j in streams) else {}
        if pushed and (talked := self.lane.decodes.launch(pushed, False)) is not None:
            self.lane.decodes.land(talked, None)

    def _close_ended(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.finishing and not job.done and not job.aborted and not self._has_more(job) and not job.in_flight:
                self._close(job, ("end", None))

    def _push_all(self, phase: list[tuple[Job, int | None]]) -> dict[Job, list[int]]:
        """Pushes each job's frames of this decode (a stream's chunks, a whole request's ``take``); returns
        job -> frames of each chunk pushed."""
        pushed: dict[Job, list[int]] = {}
        for job, take in phase:
            try:
                with self._stream_of(job):
                    if job.sid is None:
                        job.sid = self._decoder_of(job).open()
                    frames = self._push(job, take)
            except ValueError as err:  # checked at the edge already; a retired decoder says so here
                self._close(job, ("error", (500, f"request {job.rid}: {err}")))
                continue
            if frames:
                pushed[job] = frames
        return pushed

    def _fail(self, pushed: dict[Job, list[int]], err: Exception) -> None:
        n = len(pushed)
        why = f"decode failed in a step of {n} stream{'s' * (n != 1)} ({type(err).__name__}: {err})"
        log.error("serve: %s", why)
        for job in pushed:
            self._close(job, ("error", (500, f"request {job.rid}: {why}")))

    def _push(self, job: Job, take: int | None) -> list[int]:
        if job.codes is not None:
            piece = job.codes[:, job.sent_frames : job.sent_frames + (take or 0)]
            chunks = [piece] if piece.shape[1] else []
        else:
            came = []
            while job.chunks:
                came.append(job.chunks.popleft())
            job.pushed_at, chunks = [t for t, _ in came], [codes for _, codes in came]
        frames = [c.shape[1] for c in chunks]
        if sum(frames):
            self._decoder_of(job).push(job.sid, chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1))
            job.sent_frames += sum(frames)
        return frames if sum(frames) else []

    def _release(self, job: Job) -> None:
        if job.sid is not None:
            with contextlib.suppress(ValueError), self._stream_of(job):  # failed streams: closed without a decode
                self._decoder_of(job).close(job.sid)

    @property
    def _overlapped(self) -> bool:
        """Whether the streams' decodes run beside the bulk's (a lane on its own CUDA stream): then a bulk
        decode is not capped to a slice while streams are open. On a CPU a lane's decodes run in turn with
        the bulk's, and the cap bounds a chunk's wait as without one."""
        return self.lane is not None and self.lane.overlaps

    def _bulk_side(self) -> contextlib.AbstractContextManager:
        """Where a bulk decode launches: beside a lane with reserved SMs, on the SMs left (``StreamLane.bulk_side``)."""
        return self.lane.bulk_side() if self.lane is not None else contextlib.nullcontext()

    def _decoder_of(self, job: Job) -> StreamingDecoder:
        return self.lane.decoder if self.lane is not None and job.is_stream else self.decoder

    def _stream_of(self, job: Job) -> contextlib.AbstractContextManager:
        """Where ``job``'s decoder launches: a lane's stream (a closed slot's state is zeroed there, before the
        next stream's first chunk reads it), else the current one."""
        return self.lane.on_stream() if self.lane is not None and job.is_stream else contextlib.nullcontext()

    def _has_more(self, job: Job) -> bool:
        return bool(job.chunks) if job.codes is None else job.sent_frames < job.codes.shape[1]
