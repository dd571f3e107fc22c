"""``AsyncD2HCallback``: a step's outputs go to the host on a copy stream while the next step computes.

vLLM-Omni's ``OmniGenerationAsyncOutput`` in Lightning. After each predict step on CUDA the copy
stream waits for the compute stream, copies every device tensor of the step's multimodal outputs
into one pinned buffer from a reused pool (``non_blocking``), records an event and returns: the loop
launches the next batch at once. The output is finalized (event waited, per-request payloads copied
out of the buffer, buffer returned to the pool) only when consumed: at the next step's end, by a
writer, or at epoch end. Without CUDA it does nothing and the loop's synchronous path runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from omni_lightning.runner.output import OmniModelRunnerOutput

_ALIGN = 256  # bytes: every tensor in a buffer starts aligned for any dtype and for fast DMA


class PinnedPool:
    """Pinned host byte buffers, reused: in steady state a step allocates no pinned memory."""

    def __init__(self, min_bytes: int = 1 << 20) -> None:
        self.min_bytes = min_bytes
        self._free: list[torch.Tensor] = []
        self.open = True
        self.allocations = 0  # pinned allocations made so far (tests and benchmarks read it)
        self.in_use = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        fitting = [b for b in self._free if b.numel() >= nbytes]
        self.in_use += 1
        if fitting:
            buffer = min(fitting, key=torch.Tensor.numel)
            self._free.remove(buffer)
            return buffer
        self.allocations += 1
        capacity = max(self.min_bytes, 1 << (max(nbytes, 1) - 1).bit_length())  # powers of two: few sizes
        return torch.empty(capacity, dtype=torch.uint8, pin_memory=True)

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
        return sum(b.numel() for b in self._free)


def _device_leaves(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _device_leaves(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _device_leaves(v, out)


class PinnedHostTransfer:
    """One step's device tensors copied into one pinned buffer on ``stream``; see module docstring."""

    def __init__(self, outputs: Mapping[str, Any], stream: torch.cuda.Stream, pool: PinnedPool) -> None:
        leaves: list[torch.Tensor] = []
        _device_leaves(outputs, leaves)
        offsets, total = [], 0
        for t in leaves:
            offsets.append(total)
            total += -(-t.nbytes // _ALIGN) * _ALIGN
        self._outputs = outputs
        self._pool = pool
        self._buffer = pool.acquire(total)
        self._host: dict[int, torch.Tensor] = {}
        stream.wait_stream(torch.cuda.current_stream(leaves[0].device))
        with torch.cuda.stream(stream):
            for t, offset in zip(leaves, offsets):
                dst = self._buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
                dst.copy_(t, non_blocking=True)
                self._host[id(t)] = dst
        self._event = torch.cuda.Event()
        self._event.record(stream)
        # `outputs` keeps the device tensors alive until wait(): the allocator cannot hand their
        # memory to the next step while the copy still reads it

    def wait(self) -> Mapping[str, Any]:
        self._event.synchronize()

        def swap(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return self._host.get(id(value), value)
            if isinstance(value, Mapping):
                return {k: swap(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(swap(v) for v in value)
            return value

        host = swap(self._outputs)
        self._outputs = None  # device tensors may go now
        return host

    def release(self) -> None:
        if self._buffer is not None:
            self._host.clear()
            self._pool.release(self._buffer)
            self._buffer = None


class AsyncD2HCallback(Callback):
    """Overlaps each predict step's device-to-host copies with the next step (CUDA only).

    The pinned pool lives as long as the callback, so repeated ``predict`` calls allocate no pinned
    memory after the first; it holds a few buffers (two steps' outputs, rounded up to powers of
    two). ``close()`` frees them; an exception during predict frees them too.
    """

    def __init__(self) -> None:
        self.stream: torch.cuda.Stream | None = None
        self.pool = PinnedPool()
        self.transfers = 0  # copies started (tests and benchmarks read it)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if not self.pool.open:
            self.pool = PinnedPool()

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Starts the host copy of a runner output; leaves every other output alone.

        Not done for plain outputs (anything not ``MultimodalOutputs``): stock Lightning hands them to
        the hooks as returned and moves them to the CPU synchronously inside its private
        ``_predict_step``; overlapping that copy would mean replacing that step, which omni_lightning
        keeps stock so that such outputs behave exactly as on ``lightning.Trainer``.
        """
        if self.stream is None or not isinstance(outputs, OmniModelRunnerOutput):
            return
        mm = outputs.multimodal_outputs
        if mm is None or outputs.in_flight:  # already built, or already handed to a transfer
            return
        leaves: list[torch.Tensor] = []
        _device_leaves(mm, leaves)
        if leaves:
            outputs.set_host_transfer(PinnedHostTransfer(mm, self.stream, self.pool))
            self.transfers += 1

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
