"""``AsyncD2HCallback``: a step's outputs go to the host on a copy stream while the next step computes.

vLLM-Omni's ``OmniGenerationAsyncOutput`` in Lightning. After each predict step on CUDA the copy
stream waits for the compute stream, copies every device tensor of the step's multimodal outputs
into one pinned buffer from a reused pool (``non_blocking``), records an event and returns: the loop
launches the next batch at once. The output is finalized (event waited, per-request payloads copied
out of the buffer, buffer returned to the pool) only when consumed: at the next step's end, by a
writer, or at epoch end. Without CUDA it does nothing and the loop's synchronous path runs.

The CUDA primitives (streams, events, the asynchronous copy, pinned allocation) sit behind
:class:`CudaCopies`; anything with the same methods can replace it, which is how the tests run this
file's pool and transfer logic through real Lightning trainers on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from omni_lightning.runner.host_weights import pinned_bytes
from omni_lightning.runner.output import OmniModelRunnerOutput

_ALIGN = 256  # bytes: every tensor in a buffer starts aligned for any dtype and for fast DMA


class Event(Protocol):
    """What a transfer needs of an event; ``torch.cuda.Event`` is one."""

    def synchronize(self) -> None: ...


class Stream(Protocol):
    """What a transfer needs of a stream; ``torch.cuda.Stream`` is one."""

    def wait_stream(self, stream: Any) -> None: ...

    def record_event(self) -> Event: ...


class Copies(Protocol):
    """The device primitives behind the asynchronous copy (see :class:`CudaCopies`)."""

    def new_stream(self, device: torch.device) -> Stream: ...

    def current_stream(self, device: torch.device) -> Stream: ...

    def is_device_tensor(self, t: torch.Tensor) -> bool: ...

    def copy(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], stream: Stream) -> None:
        """Enqueues ``dst.copy_(src)`` for each (dst, src) on ``stream`` and returns at once."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer ``uint8[nbytes]`` the copies can target asynchronously."""


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
        return pinned_bytes(nbytes)


class PinnedPool:
    """Pinned host byte buffers, reused: in steady state a step allocates no pinned memory.

    Buffers are powers of two (at least ``min_bytes``), so a job of many output sizes still holds
    few of them. ``allocate(nbytes)`` makes a buffer (pinned memory by default).
    """

    def __init__(self, min_bytes: int = 1 << 20, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self.min_bytes = min_bytes
        self.allocate = allocate or CudaCopies().allocate
        self._free: list[torch.Tensor] = []
        self.open = True
        self.allocations = 0  # pinned allocations made so far (tests and benchmarks read it)
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

    One per process because a pinned allocation is slow and stops the device (``cudaHostAlloc``:
    six of them cost 0.15 s of one warm 6,000 s predict on an H200), and a Trainer made per predict
    call (bench scripts, servers) would otherwise allocate its buffers again while the last Trainer's
    still wait in a reference cycle for the garbage collector. Not thread-safe: one predict at a time
    per process uses it (as one loop drives one engine).
    """
    pool = _SHARED.get(min_bytes)
    if pool is None or not pool.open:
        pool = _SHARED[min_bytes] = PinnedPool(min_bytes)
    return pool


def _device_leaves(value: Any, is_device: Callable[[torch.Tensor], bool], out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if is_device(value):
            out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _device_leaves(v, is_device, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _device_leaves(v, is_device, out)


class PinnedHostTransfer:
    """One step's device tensors copied into one pooled buffer on ``stream``; see module docstring."""

    def __init__(
        self, outputs: Mapping[str, Any], stream: Stream, pool: PinnedPool, copies: Copies | None = None
    ) -> None:
        copies = copies or CudaCopies()
        leaves: list[torch.Tensor] = []
        _device_leaves(outputs, copies.is_device_tensor, leaves)
        offsets, total = [], 0
        for t in leaves:
            offsets.append(total)
            total += -(-t.nbytes // _ALIGN) * _ALIGN
        self._outputs = outputs
        self._pool = pool
        self._buffer: torch.Tensor | None = pool.acquire(total)
        self._host: dict[int, torch.Tensor] = {}
        pairs = []
        for t, offset in zip(leaves, offsets):
            dst = self._buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            pairs.append((dst, t))
            self._host[id(t)] = dst
        if leaves:
            stream.wait_stream(copies.current_stream(leaves[0].device))
            copies.copy(pairs, stream)
        self._event = stream.record_event()
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

    The pinned pool outlives the callback (:func:`shared_pool`: one per process), so repeated
    ``predict`` calls allocate no pinned memory after the first, whatever Trainer runs them; it holds
    a few buffers (two steps' outputs, rounded up to powers of two, at least ``min_bytes``).
    ``close()`` frees them (the next callback starts a new pool); an exception during predict frees
    them too. ``copies`` replaces the CUDA primitives (:class:`CudaCopies`) and then acts on any device;
    the tests pass host stand-ins through it.
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
        _device_leaves(mm, self._active.is_device_tensor, leaves)
        if leaves:
            outputs.set_host_transfer(PinnedHostTransfer(mm, self.stream, self.pool, self._active))
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
