"""``Decodes``: a serving step's decodes from launch to each client's audio.

``launch`` steps the decoder over what the loop pushed and starts the copy of its audio to the host
(``host_audio.py``); ``land`` waits for that copy and hands each client its part, a stream's split per chunk
it sent (``output_length`` of each). Between the two the device computes: a decode launched after another
queues behind it on the device, so a loop that launches the next decode before landing the last keeps the
device busy while the host hands out audio (``DecodeLoop``'s ``pipeline``). Each landing times the decode
from its launch, or from the last landing when it was queued behind that one (the socket's reads left out):
the bulk decodes' time per frame prices the bulk slice (``schedule.FrameCost``), every decode's time is the
``step_seconds`` metric (the streams' decodes also ``stream_step_seconds``); a step that first ran a shape
(a CUDA graph captured, or new kernel plans, after the warm-up) counts in ``new_shapes``, and every step's
forwards, frames decoded and frames computed (padding included) count in ``forwards``, ``frames`` and
``computed_frames``; a stream's chunk, from its arrival in the loop to its audio handed out, counts in
``stream_chunk_seconds`` (the server's own share of a chunk's latency: the rest is the sockets' and the
client's), a stream's first chunk in ``stream_first_chunk_seconds`` too (its first audio's share). A decode
that fails is told to its clients through ``fail``. ``on``: entered around each launch (default: nothing, the
current CUDA stream); a stream lane's makes its high-priority stream current (``stream_lane.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omni_lightning.engine.streaming import StreamingDecoder
from omni_lightning.serving.host_audio import HostAudio, HostCopy
from omni_lightning.serving.jobs import Job
from omni_lightning.serving.schedule import FrameCost


@dataclass
class Decode:
    """A decode launched: each job's frames per chunk pushed (and whether they start it), its outputs'
    sizes, their copy to the host, when it was launched, and whether it was the bulk slice."""

    pushed: dict[Job, list[int]]
    firsts: list[bool]
    sizes: list[int]
    copy: HostCopy
    start: float
    bulk: bool


class Decodes:
    """Launches and lands ``decoder``'s decodes (see the module docstring); ``fail(pushed, err)`` tells a
    failed decode's clients."""

    def __init__(
        self,
        decoder: StreamingDecoder,
        metrics: Any,
        fail: Callable[[dict, Exception], None],
        on: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.decoder, self.metrics, self.fail, self.on = decoder, metrics, fail, on
        self.config, self.cost, self.host = decoder.config, FrameCost(), HostAudio()
        self.landed = 0.0  # when the last decode's audio landed

    def launch(self, pushed: dict[Job, list[int]], bulk: bool) -> Decode | None:
        """Steps the decoder over what was pushed and starts its audio's copy (None: it failed, told)."""
        start = time.perf_counter()
        work = getattr(getattr(self.decoder, "engine", None), "work", None)  # (a test double may have none)
        before = dict(work) if work is not None else None
        try:
            with self.on():
                out = self.decoder.step()
                outs = [out[job.sid] for job in pushed]
                copy = self.host.start(outs)
        except Exception as err:
            self.fail(pushed, err)
            return None
        for job in pushed:
            job.in_flight += 1
        if before is not None and self.metrics is not None:
            self._count(before, work)
        firsts = [job.sent_frames == sum(frames) for job, frames in pushed.items()]
        return Decode(pushed, firsts, [o.shape[-1] for o in outs], copy, start, bulk)

    def _count(self, before: dict, work: dict) -> None:
        """The engine's counters' growth over one decode, into ``/metrics``."""
        m = self.metrics
        for counter, key in ((m.forwards, "forwards"), (m.frames, "frames"), (m.computed_frames, "computed")):
            counter.inc(work[key] - before[key])
        if work["new_shapes"] > before["new_shapes"]:  # a capture or new kernel plans, in the clients' way
            m.new_shapes.inc(work["new_shapes"] - before["new_shapes"])
            m.new_shape_seconds.inc(work["new_shape_s"] - before["new_shape_s"])

    def land(self, d: Decode, between: Callable[[], None] | None) -> None:
        """Reads the socket (``between``), waits for ``d``'s audio and hands each client still there its part."""
        read = 0.0
        if between is not None:
            mark = time.perf_counter()
            between()
            read = time.perf_counter() - mark
        for job in d.pushed:
            job.in_flight -= 1
        try:
            host = d.copy.wait()
        except Exception as err:
            self.fail(d.pushed, err)
            return
        done = time.perf_counter()
        seconds = done - max(d.start, self.landed) - read
        self.landed = done
        if d.bulk:
            self.cost.update(sum(sum(f) for f in d.pushed.values()), seconds)
        if self.metrics is not None:
            self.metrics.step_seconds.observe(seconds)
            if not d.bulk:
                self.metrics.stream_step_seconds.observe(seconds)
        timed = self.metrics is not None and not d.bulk
        for (job, frames), first, samples in zip(d.pushed.items(), d.firsts, host.split(d.sizes, dim=-1)):
            if not job.aborted and not job.done:
                opening = job.first_audio is None
                self._deliver(job, self._split(samples, frames, first))
                if timed:  # each chunk from its arrival in the loop
                    now = time.perf_counter()
                    for came in job.pushed_at:
                        self.metrics.stream_chunk_seconds.observe(now - came)
                    if opening and job.pushed_at:
                        self.metrics.stream_first_chunk_seconds.observe(now - job.pushed_at[0])

    def _split(self, samples: torch.Tensor, frames: list[int], first: bool) -> list[torch.Tensor]:
        """A decode's samples of one stream, cut per chunk pushed (``output_length`` of each)."""
        up, tail = self.config.total_upsample, self.config.tail
        sizes = [n * up - (tail if first and i == 0 else 0) for i, n in enumerate(frames)]
        return list(samples.split(sizes, dim=-1)) if len(sizes) > 1 else [samples]

    def _deliver(self, job: Job, pieces: list[torch.Tensor]) -> None:
        if self.metrics is not None:
            if job.first_audio is None:
                self.metrics.first_audio_seconds.observe(time.perf_counter() - job.created)
            self.metrics.audio_seconds.inc(sum(p.shape[-1] for p in pieces) / self.config.sample_rate)
        if job.first_audio is None:
            job.first_audio = time.perf_counter()
        job.sink("audio", pieces)
