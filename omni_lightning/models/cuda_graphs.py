"""``CUDAGraphDecoder``: Code2Wav forwards replayed from CUDA graphs, one per (batch, frames) bucket.

Real jobs have about as many distinct lengths as requests, and every per-shape cost (cuDNN plans,
Triton specializations, a graph capture) would otherwise be paid again and again. So a batch
``[B, Q, T]`` is padded up to a bucket: ``B`` to the next of ``ShapeBuckets.batches`` (1, 2, 4, ...,
64) and ``T`` to the next of ``ShapeBuckets.frames`` (every 25 frames, 2 s, up to 400, then 500 ...
1500). Padding is exact: a request's first ``output_length(T)`` samples depend on its own first
``T`` frames only (the model is causal up to one trimmed frame of look-ahead, and batch rows never
mix), so the pad frames and pad rows are cut off and change nothing.

The first batch of a bucket runs eagerly at the bucket's shape (which warms every library for that
shape, and is that batch's result), then the forward is captured into a CUDA graph with static
input and output buffers; later batches of the bucket copy their codes into the static input,
replay, and copy the trimmed output out (the next replay overwrites the static output, while the
asynchronous host copy of this step may still read it). Every graph allocates from one shared
memory pool, through PyTorch's caching allocator, so graph memory counts against
``torch.cuda.set_per_process_memory_fraction`` (``gpu_memory_utilization``). Shapes outside the
buckets (more than 64 requests, more than 1500 frames, or more than ``max_elements`` padded frames
in a batch) run eagerly at their own shape. A capture that runs out of memory leaves its bucket
eager. ``capture`` replaces ``torch.cuda.graph``; the tests pass a stand-in that records the
callable, to run the bucket, buffer and fallback logic on a CPU.

Not done: graphs are not shared across processes, and nothing is captured ahead of the data (a
capture needs valid codes and the shapes a job will use; the first batch of each bucket brings both).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShapeBuckets:
    """The padded shapes batches run at; ``bucket`` is None outside them."""

    frames: tuple[int, ...] = tuple(range(25, 401, 25)) + (500, 600, 800, 1000, 1250, 1500)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # batch x frames above which a shape runs eagerly (a graph holds its activations' peak)
    max_elements: int = 32 * 400

    def bucket(self, batch: int, frames: int) -> tuple[int, int] | None:
        padded_frames = next((f for f in sorted(self.frames) if f >= frames), None)
        padded_batch = next((b for b in sorted(self.batches) if b >= batch), None)
        if padded_frames is None or padded_batch is None or padded_batch * padded_frames > self.max_elements:
            return None
        return padded_batch, padded_frames


class GraphCapture(Protocol):
    """Records ``fn`` (a forward reading static inputs); returns ``(replay, static_output)``."""

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]: ...


class TorchGraphCapture:
    """``torch.cuda.graph`` captures, all into one memory pool."""

    def __init__(self) -> None:
        self.pool: Any = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


@dataclass
class _Graph:
    codes: torch.Tensor  # static input [batch, Q, frames]
    out: torch.Tensor  # static output [batch, 1, output_length(frames)]
    replay: Callable[[], Any]


@dataclass
class GraphStats:
    captures: int = 0
    capture_s: float = 0.0  # eager warm-up + capture, summed over buckets
    replays: int = 0
    eager: int = 0  # forwards outside the buckets (or while grad is enabled)
    shapes: set[tuple[int, int]] = field(default_factory=set)  # buckets seen


class CUDAGraphDecoder:
    """``model(codes)`` through bucketed CUDA graphs; call it like the model (see module docstring).

    Returns ``[B, 1, output_length(T)]`` in ``out_dtype`` (default: the model's), in storage of
    its own. Call :meth:`refresh` after moving, casting or replacing the model's tensors: graphs
    hold their addresses (in-place updates, such as optimizer steps or EMA swaps, need nothing).
    """

    def __init__(
        self,
        model: nn.Module,
        buckets: ShapeBuckets | None = None,
        capture: GraphCapture | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.buckets = buckets or ShapeBuckets()
        self.capture = capture or TorchGraphCapture()
        self.out_dtype = out_dtype
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.eager_buckets: set[tuple[int, int]] = set()  # captures that failed
        self.stats = GraphStats()
        self._fingerprint = self._tensors_fingerprint()

    def _tensors_fingerprint(self) -> tuple:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        flags = getattr(self.model, "fast_decoder", None)
        return flags, tuple((t.data_ptr(), t.dtype, t.device, tuple(t.shape)) for t in tensors)

    def refresh(self) -> bool:
        """Drops every graph if the model's tensors moved since capture; True if it dropped any."""
        fingerprint = self._tensors_fingerprint()
        if fingerprint == self._fingerprint:
            return False
        self._fingerprint = fingerprint
        dropped = bool(self.graphs)
        self.graphs.clear()
        self.eager_buckets.clear()
        return dropped

    def _forward(self, codes: torch.Tensor) -> torch.Tensor:
        # static buffers may hold stale (valid or pad) codes: keep every lookup inside the codebook
        return self.model(codes.clamp(0, self.model.config.codebook_size - 1))

    def _trimmed(self, wav: torch.Tensor, batch: int, frames: int) -> torch.Tensor:
        out = wav[:batch, :, : self.model.config.output_length(frames)]
        return out.to(dtype=self.out_dtype or out.dtype, memory_format=torch.contiguous_format, copy=True)

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        batch, _, frames = codes.shape
        key = self.buckets.bucket(batch, frames)
        if key is None or key in self.eager_buckets or torch.is_grad_enabled():
            self.stats.eager += 1
            return self._trimmed(self._forward(codes), batch, frames)
        self.stats.shapes.add(key)
        graph = self.graphs.get(key)
        if graph is None:
            return self._capture(key, codes)
        graph.codes[:batch, :, :frames].copy_(codes)
        graph.replay()
        self.stats.replays += 1
        return self._trimmed(graph.out, batch, frames)

    def _capture(self, key: tuple[int, int], codes: torch.Tensor) -> torch.Tensor:
        batch, n_q, frames = codes.shape
        start = time.perf_counter()
        static = torch.zeros((key[0], n_q, key[1]), dtype=codes.dtype, device=codes.device)
        static[:batch, :, :frames].copy_(codes)
        result = self._trimmed(self._forward(static), batch, frames)  # warm-up at the bucket's shape
        try:
            replay, out = self.capture(lambda: self._forward(static))
        except torch.OutOfMemoryError:
            self.eager_buckets.add(key)
            log.warning("no CUDA graph for batch %d x %d frames: out of memory; it runs eagerly", *key)
            return result
        self.graphs[key] = _Graph(static, out, replay)
        seconds = time.perf_counter() - start
        self.stats.captures += 1
        self.stats.capture_s += seconds
        log.info("captured CUDA graph for batch %d x %d frames in %.2f s (%d graphs)", *key, seconds, len(self.graphs))
        return result
