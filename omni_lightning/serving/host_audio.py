"""``HostAudio``: a decode's audio copied to the host in one copy, into buffers reused from decode to decode
(pinned under CUDA: one fast copy, not a pageable one per client).

``start`` queues the copy behind the decode on the device and returns at once; ``HostCopy.wait`` waits for
that copy alone (an event, not the whole stream: a decode launched after it may still be running). Two
buffers take turns, so one decode's audio can wait to be handed out while the next decode's copy lands:
a view is valid until the copy two ``start`` calls later; a consumer that keeps a piece copies it
(``jobs.queue_sink`` on another thread; ZeroMQ copies what it sends). On a CPU the copy is done when ``start`` returns.
"""

from __future__ import annotations

import torch


class HostCopy:
    """A copy under way: :meth:`wait` returns the host tensor ``[1, total]`` once it has landed."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.host, self.event = host, event

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


class HostAudio:
    """The buffers; :meth:`start` copies a decode's outputs into one of them side by side."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.turn = 0

    def start(self, outs: list[torch.Tensor]) -> HostCopy:
        """``outs`` (float32 ``[1, m_i]``, on one device) on their way into one host tensor ``[1, sum m_i]``."""
        total, cuda = sum(o.shape[-1] for o in outs), outs[0].is_cuda
        self.turn = 1 - self.turn
        buffer = self.buffers[self.turn]
        if buffer is None or buffer.shape[-1] < total:
            buffer = torch.empty((1, max(total, 1 << 16) * 2), dtype=torch.float32, pin_memory=cuda)
            self.buffers[self.turn] = buffer
        host = buffer[:, :total]
        if not cuda:
            torch.cat(outs, dim=-1, out=host)
            return HostCopy(host, None)
        host.copy_(torch.cat(outs, dim=-1), non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(outs[0].device))
        return HostCopy(host, event)
