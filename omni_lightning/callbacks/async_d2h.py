"""``AsyncD2HCallback``: each predict step's runner output goes to the host on a copy stream while the
next step computes (CUDA only).

vLLM-Omni's ``OmniGenerationAsyncOutput`` in Lightning. The callback owns the resources: a copy stream
per predict and pinned host buffers from a pool reused across predicts. At each batch end it asks the
runner output to start its copy (``OmniModelRunnerOutput.start_host_copy``); the output finalizes itself
when consumed (the loop at the next step's end or at epoch end, or a writer). Without CUDA it does
nothing and outputs are built synchronously.

The CUDA primitives sit behind :class:`CudaCopies` (the ``Copies`` protocol of ``runner/output.py``);
anything with the same methods replaces them, which is how the tests run the pool and the copies
through real Lightning trainers on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from omni_lightning.runner.output import Copies, OmniModelRunnerOutput, Stream

__all__ = ["AsyncD2HCallback", "Copies", "CudaCopies", "PinnedPool", "shared_pool"]


class CudaCopies:
    """The real primitives: CUDA streams and events, ``non_blocking`` copies, pinned host memory."""

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def copy(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """Pinned host byte buffers, reused: in steady state a step allocates no pinned memory.

    Buffers are powers of two (at least ``min_bytes``), so a job of many output sizes still holds few
    of them. ``allocate(nbytes)`` makes a buffer (pinned memory by default). Not thread-safe.
    """

    def __init__(self, min_bytes: int = 1 << 20, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self.min_bytes = min_bytes
        self.allocate = allocate or CudaCopies().allocate
        self._free: list[torch.Tensor] = []
        self.open = True
        self.allocations = 0  # buffers allocated so far (tests and benchmarks read it)
        self.in_use = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """The smallest idle buffer of at least ``nbytes`` bytes, or a new one."""
        fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        self.in_use += 1
        if fitting:
            # by position: `list.remove` would compare tensors by value (elementwise, any size)
            best = min(fitting, key=lambda i: self._free[i].numel())
            return self._free.pop(best)
        self.allocations += 1
        capacity = max(self.min_bytes, 1 << (max(nbytes, 1) - 1).bit_length())
        return self.allocate(capacity)

    def release(self, buffer: torch.Tensor) -> None:
        self.in_use -= 1
        if self.open:
            self._free.append(buffer)

    def close(self) -> None:
        """Frees the idle buffers; buffers released from now on are freed too."""
        self.open = False
        self._free.clear()

    @property
    def pinned_bytes(self) -> int:
        """Bytes held by idle buffers."""
        return sum(b.numel() for b in self._free)


_SHARED: dict[int, PinnedPool] = {}


def shared_pool(min_bytes: int = 1 << 20) -> PinnedPool:
    """The process's pool of pinned buffers of at least ``min_bytes``, shared by every
    :class:`AsyncD2HCallback` on the real CUDA copies; a new one once it was closed.

    One per process because a pinned allocation is slow and stalls the device, and a Trainer made per
    predict call (scripts, servers) would otherwise allocate its buffers again. One predict at a time
    per process uses it (as one loop drives one engine).
    """
    pool = _SHARED.get(min_bytes)
    if pool is None or not pool.open:
        pool = _SHARED[min_bytes] = PinnedPool(min_bytes)
    return pool


class AsyncD2HCallback(Callback):
    """Starts each runner output's host copy on a copy stream at its batch end (CUDA only).

    The pinned pool outlives the callback (:func:`shared_pool`: one per process), so repeated
    ``predict`` calls allocate no pinned memory after the first, whatever Trainer runs them; it holds
    a few buffers (two steps' outputs, rounded up to powers of two, at least ``min_bytes``).
    ``close()`` frees them (the next callback starts a new pool); an exception during predict frees
    them too. ``copies`` replaces the CUDA primitives (:class:`CudaCopies`) and then acts on any device.

    Plain outputs (anything but a runner output) are left alone: Lightning's step moves them to the
    CPU synchronously, as on a stock trainer.
    """

    def __init__(self, copies: Copies | None = None, min_bytes: int = 1 << 20) -> None:
        self.copies = copies
        self.min_bytes = min_bytes
        self.stream: Stream | None = None
        self._active: Copies | None = None
        self.pool = self._new_pool()
        self.transfers = 0  # copies started (tests and benchmarks read it)

    def _new_pool(self) -> PinnedPool:
        if self.copies is None:
            return shared_pool(self.min_bytes)
        return PinnedPool(self.min_bytes, allocate=self.copies.allocate)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        self._active = self.copies or (CudaCopies() if device.type == "cuda" else None)
        self.stream = self._active.new_stream(device) if self._active is not None else None
        if not self.pool.open:
            self.pool = self._new_pool()

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.stream is not None and isinstance(outputs, OmniModelRunnerOutput):
            self.transfers += outputs.start_host_copy(self.stream, self.pool, self._active)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stream = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # the loop's teardown, which runs next, waits for the copies in flight and releases their
        # buffers; a closed pool frees them instead of keeping them
        self.close()

    def close(self) -> None:
        """Frees the pinned buffers."""
        self.pool.close()
        self.stream = None
