"""Host stand-ins for the CUDA primitives behind ``AsyncD2HCallback`` (``Copies`` protocol).

They replace only what a CPU lacks (streams, events, asynchronous copies, pinned memory) and keep
the semantics that make the real thing hard to get right: a copy lands in its buffer only when an
event recorded after it is synchronized, and until then the buffer holds poison (0xFF bytes: NaN
as float32). Code that reads a buffer before waiting, or hands out a view into a buffer the pool
reuses, sees NaN.
"""

from __future__ import annotations

import torch


class HostEvent:
    def __init__(self, stream: HostStream, upto: int) -> None:
        self.stream, self.upto = stream, upto
        self.synchronized = False

    def synchronize(self) -> None:
        self.stream.run(self.upto)
        self.synchronized = True


class HostStream:
    def __init__(self) -> None:
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0  # copies of the queue carried out so far
        self.events: list[HostEvent] = []
        self.waits = 0

    def wait_stream(self, stream: HostStream) -> None:
        self.waits += 1  # host compute is synchronous: nothing to order

    def record_event(self) -> HostEvent:
        event = HostEvent(self, len(self.queue))
        self.events.append(event)
        return event

    def run(self, upto: int) -> None:
        while self.done < upto:
            dst, src = self.queue[self.done]
            dst.copy_(src)
            self.done += 1


class HostCopies:
    """Implements ``omni_lightning.callbacks.async_d2h.Copies`` on the CPU; records what it was asked."""

    def __init__(self) -> None:
        self.streams: list[HostStream] = []
        self.compute = HostStream()
        self.allocated: list[int] = []

    def new_stream(self, device: torch.device) -> HostStream:
        self.streams.append(HostStream())
        return self.streams[-1]

    def current_stream(self, device: torch.device) -> HostStream:
        return self.compute

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def copy(self, pairs, stream: HostStream) -> None:
        for dst, src in pairs:
            dst.view(-1).view(torch.uint8).fill_(0xFF)  # undefined until the copy lands
            stream.queue.append((dst, src))

    def allocate(self, nbytes: int) -> torch.Tensor:
        self.allocated.append(nbytes)
        return torch.full((nbytes,), 0xFF, dtype=torch.uint8)

    @property
    def events(self) -> list[HostEvent]:
        return [e for s in self.streams for e in s.events]
