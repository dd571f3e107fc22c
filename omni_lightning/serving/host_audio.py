"""``HostAudio``: a decode step's audio copied to the host in one copy, into one buffer reused from step to
step (pinned under CUDA: one fast copy, not a pageable one per client). Its views are valid until the next
step: a consumer that keeps a piece copies it (``jobs.queue_sink``; ZeroMQ copies what it sends)."""

from __future__ import annotations

import torch


class HostAudio:
    """The buffer; :meth:`gather` fills it with a step's outputs side by side and returns that part."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def gather(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """``outs`` (float32 ``[1, m_i]``, on one device) as one host tensor ``[1, sum m_i]``."""
        total = sum(o.shape[-1] for o in outs)
        if self.buffer is None or self.buffer.shape[-1] < total:
            self.buffer = torch.empty((1, max(total, 1 << 16) * 2), dtype=torch.float32, pin_memory=outs[0].is_cuda)
        host = self.buffer[:, :total]
        if outs[0].is_cuda:
            host.copy_(torch.cat(outs, dim=-1), non_blocking=True)
            torch.cuda.current_stream(outs[0].device).synchronize()
        else:
            torch.cat(outs, dim=-1, out=host)
        return host
