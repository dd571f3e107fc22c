"""``ServeMetrics``: what ``GET /metrics`` reports, in Prometheus' text format (``prometheus_client``), one
registry per app (two servers in one process count apart). Where ``PROMETHEUS_MULTIPROC_DIR`` is set (the
command line's engine and front processes: ``supervisor.py``), every process writes its values there and
any front's ``/metrics`` reports their sum (gauges: over the processes alive).

Not done: per-client labels (unbounded cardinality) and GPU memory gauges (the engine's log line has them).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: 1 ms to 30 s (a CPU step of a few hundred frames takes seconds)
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class ServeMetrics:
    """Requests by route and status, audio seconds sent, open streams, queue depth, and the first-audio
    and decode latency histograms (every decode; the streams' own decodes apart: the bulk's are the rest), a
    stream chunk's time in the decode loop and in the front (its message read to its audio sent: the loop's
    time, the hand-offs between processes and the front's own work), each stream's first chunk apart, the two
    hand-offs of a chunk between a front and its engine process (each timed by its receiver from the sender's
    stamp), and the engine's forwards with their frames decoded and computed (the rest is padding)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("omni_requests", "Requests and streams answered", ["route", "status"], registry=r)
        self.audio_seconds = Counter("omni_audio_seconds", "Seconds of audio decoded and sent", registry=r)
        live = {"multiprocess_mode": "livesum"} if multiprocess() else {}
        self.open_streams = Gauge("omni_open_streams", "Clients holding a decode slot", registry=r, **live)
        self.queue_depth = Gauge("omni_queue_depth", "Whole requests waiting for a decode slot", registry=r, **live)

        def latency(name: str, what: str) -> Histogram:
            return Histogram(name, what, buckets=LATENCY_BUCKETS, registry=r)

        self.first_audio_seconds = latency("omni_first_audio_seconds", "From a client's codes to its first audio")
        self.step_seconds = latency("omni_step_seconds", "One decode (streams' chunks, or bulk)")
        self.stream_step_seconds = latency("omni_stream_step_seconds", "One decode of streams' chunks alone")
        self.stream_chunk_seconds = latency(
            "omni_stream_chunk_seconds", "A stream chunk from its arrival in the decode loop to its audio handed out"
        )
        self.stream_first_chunk_seconds = latency(
            "omni_stream_first_chunk_seconds", "A stream's first chunk from its arrival in the loop to its audio"
        )
        self.stream_chunk_front_seconds = latency(
            "omni_stream_chunk_front_seconds", "A stream chunk from its message read by a front to its audio sent"
        )
        self.stream_first_chunk_front_seconds = latency(
            "omni_stream_first_chunk_front_seconds", "A stream's first chunk from its message read to its audio sent"
        )
        self.stream_chunk_to_engine_seconds = latency(
            "omni_stream_chunk_to_engine_seconds", "A stream chunk from its front's send to its engine's read"
        )
        self.stream_audio_to_front_seconds = latency(
            "omni_stream_audio_to_front_seconds", "A stream chunk's audio from its engine's send to its front's read"
        )
        self.new_shapes = Counter("omni_new_shapes", "Decode shapes first run while serving", registry=r)
        self.new_shape_seconds = Counter("omni_new_shape_seconds", "Host seconds those first runs took", registry=r)
        self.forwards = Counter("omni_forwards", "The engine's forwards (a decode runs one or more)", registry=r)
        self.frames = Counter("omni_frames", "Codec frames decoded", registry=r)
        self.computed_frames = Counter(
            "omni_computed_frames", "Frames the forwards computed (rows x chunk: decoded and padding)", registry=r
        )

    def text(self) -> bytes:
        if not multiprocess():
            return generate_latest(self.registry)
        from prometheus_client import multiprocess as shared

        registry = CollectorRegistry()
        shared.MultiProcessCollector(registry)
        return generate_latest(registry)


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
