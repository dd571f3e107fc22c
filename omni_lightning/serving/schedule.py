"""What the next decode step takes: latency classes, as vLLM's chunked prefill favours decodes.

A WebSocket stream is latency-bound: every chunk it has sent goes into the next step, whole. A whole
request is throughput-bound: it sends up to ``request_frames`` a step. While any stream is open, the
whole requests' frames in one step are capped so that the step costs about ``bulk_slice_s`` seconds of
them at the engine's measured cost per frame (:class:`FrameCost`), oldest request first; so a stream's
chunk waits at most about one slice of bulk work, whatever the bulk load. With no stream open, every
whole request sends its ``request_frames`` (the engine's widest steps, for throughput).

Not done: priorities between whole requests (first come, first served) or between streams (all of them
go in every step: their frames are few), and deadlines.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FrameCost:
    """The engine's seconds per frame, an exponential average over steps (``update`` after each step).
    Small steps cost more per frame (a fixed launch cost), so the estimate errs towards shorter slices."""

    seconds_per_frame: float = 0.0
    weight: float = 0.2

    def update(self, frames: int, seconds: float) -> None:
        if frames <= 0 or seconds <= 0:
            return
        sample = seconds / frames
        cost = self.seconds_per_frame
        self.seconds_per_frame = sample if cost == 0 else (1 - self.weight) * cost + self.weight * sample

    def frames_in(self, seconds: float, least: int) -> int:
        """Frames that cost about ``seconds`` (at least ``least``; no estimate yet: ``least``)."""
        if self.seconds_per_frame <= 0:
            return least
        return max(least, int(seconds / self.seconds_per_frame))


def bulk_frames(
    remaining: list[int], request_frames: int, streams_open: bool, cost: FrameCost, slice_s: float, least: int = 8
) -> list[int]:
    """Frames each whole request sends this step, given each one's ``remaining`` frames (oldest first).

    With a stream open, their sum is at most about ``slice_s`` of engine time (at least ``least`` frames,
    so bulk work always advances); otherwise each sends ``min(request_frames, remaining)``."""
    if not streams_open:
        return [min(request_frames, n) for n in remaining]
    budget = cost.frames_in(slice_s, least)
    out = []
    for n in remaining:
        take = min(request_frames, n, budget)
        out.append(take)
        budget -= take
    return out
