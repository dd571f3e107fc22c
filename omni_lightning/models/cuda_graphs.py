"""``CUDAGraphDecoder``: Code2Wav forwards replayed from CUDA graphs, one per (batch, frames) bucket.

Real jobs have about as many distinct lengths as requests, and every per-shape cost (cuDNN plans,
Triton specializations, a graph capture) would otherwise be paid again and again. So a batch ``[B,
Q, T]`` is padded up to a bucket: ``B`` to the next of ``ShapeBuckets.batches`` (1, 2, 4, ..., 64)
and ``T`` to the next of ``ShapeBuckets.frames`` (every 10 frames, 0.8 s, up to 400, then 500 ...
1500; every 25 frames cost 11.9 % padding on a 2-30 s job at batch 32, 7.0 % of it inside the
batches). A batch of mixed lengths is first split (``ShapeBuckets.plan``, through :meth:`decode_rows`,
which ``Code2Wav.decode`` calls) into groups of similar lengths, each its own forward and bucket,
when the padding saved outweighs a replay's fixed cost: on that job padding falls from 9.6 % to
3.6 %, for 37 buckets instead of 12. Padding is exact: a request's first ``output_length(T)``
samples depend on its own first ``T`` frames only (the model is causal up to one trimmed frame of
look-ahead, and batch rows never mix), so the pad frames and pad rows are cut off and change nothing.

Graphs are bound to the addresses of the weights they read, and Lightning moves the module to the
GPU at the start of every ``predict`` (new tensors) and back to the CPU at its end. So the decoder
keeps the GPU tensors its graphs were captured with, and :meth:`refresh` (the module calls it at
every predict start) copies the model's current weights into them and points the model's parameters
and buffers back at them (``.data``): graphs survive from one predict call to the next, always read
the current weights (after fine-tuning too), and the weights are on the GPU once while predicting.
Between predict calls the decoder holds that set of weights and its graphs on the GPU; ``close()``
frees them.

The first batch of a batch-size bucket first captures that batch size's largest frame bucket up to
``warm_frames`` (on its own codes, repeated to that length: valid codes), then its own bucket: the
captures of that batch size then fit in the memory the largest one left in the shared pool, so the
pool holds about one eager peak instead of the sum of every capture's peak (captured in growing
order, as a length-sorted job would, they took 110 GB for eleven buckets of batch 32). Each capture
runs the forward eagerly once at the bucket's shape first (which warms cuDNN, cuBLAS and Triton for
that shape), and the first batch's result is that eager run's. Later batches of the bucket copy
their codes into the static input, replay, and copy the trimmed output out (the next replay
overwrites the static output, while the asynchronous host copy of this step may still read it).
Every graph allocates from one shared memory pool, through PyTorch's caching allocator, so graph
memory counts against ``torch.cuda.set_per_process_memory_fraction`` (``gpu_memory_utilization``).
Shapes outside the buckets (more than 64 requests, more than 1500 frames, or more than
``max_elements`` padded frames in a batch) run eagerly at their own shape. A capture that runs out
of memory leaves its bucket eager. ``capture`` replaces ``torch.cuda.graph``; the tests pass a
stand-in that records the callable, to run the bucket, buffer and fallback logic on a CPU.

Not done: graphs are not shared across processes, and nothing is captured ahead of the data (a
capture needs valid codes and the shapes a job will use; the first batch of each bucket brings
both).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShapeBuckets:
    """The padded shapes batches run at; ``bucket`` is None outside them."""

    frames: tuple[int, ...] = tuple(range(10, 401, 10)) + (500, 600, 800, 1000, 1250, 1500)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # batch x frames above which a shape runs eagerly (a graph holds its activations' peak)
    max_elements: int = 32 * 400
    # a batch size's first capture is its largest bucket up to this many frames (see module docstring)
    warm_frames: int = 400
    # what one more forward costs in :meth:`plan`, in padded rows x frames (a replay's fixed cost)
    group_cost: int = 64

    def bucket(self, batch: int, frames: int) -> tuple[int, int] | None:
        padded_frames = next((f for f in sorted(self.frames) if f >= frames), None)
        padded_batch = next((b for b in sorted(self.batches) if b >= batch), None)
        if padded_frames is None or padded_batch is None or padded_batch * padded_frames > self.max_elements:
            return None
        return padded_batch, padded_frames

    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """The rows of a batch (``lengths[i]`` frames each) in groups to run as separate forwards.

        Groups are runs of the length-sorted rows; the split minimizes the padded work of the groups'
        buckets (rows x frames; twice the real size for a group outside the buckets, which runs
        eagerly) plus ``group_cost`` per group. Sorted batches of 32 requests of 2-30 s pad 9.6 % as
        one group per batch and 3.6 % split (docs/performance.md). Rows keep the batch's order inside
        a group; a batch of one length stays one group.
        """
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        best = [0.0] + [math.inf] * len(order)
        cut = [0] * (len(order) + 1)
        for end in range(1, len(order) + 1):
            frames = lengths[order[end - 1]]
            for start in range(end):
                key = self.bucket(end - start, frames)
                cost = best[start] + self.group_cost + (key[0] * key[1] if key else 2 * (end - start) * frames)
                if cost < best[end]:
                    best[end], cut[end] = cost, start
        groups, end = [], len(order)
        while end:
            groups.append(sorted(order[cut[end] : end]))
            end = cut[end]
        return groups[::-1]

    def largest(self, batch: int) -> tuple[int, int]:
        """The bucket of batch size ``batch`` (a bucket's) with the most frames, up to ``warm_frames``."""
        fitting = [f for f in self.frames if batch * f <= self.max_elements and f <= self.warm_frames]
        return batch, max(fitting, default=min(self.frames))


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
    its own. Call :meth:`refresh` before a run in which the model's weights may have changed
    (moved, cast or updated): graphs replay a private copy of them.
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
        self._bound: list[torch.Tensor] | None = None  # the weights the graphs read (module docstring)
        self._flags = getattr(model, "fast_decoder", None)

    @classmethod
    def for_predict(
        cls, decoder: CUDAGraphDecoder | None, model: nn.Module, device: torch.device
    ) -> CUDAGraphDecoder | None:
        """The decoder a predict run uses: ``decoder`` if it serves ``model``, else a new one on CUDA
        (None elsewhere); refreshed, and marked for :meth:`report`."""
        if decoder is None or decoder.model is not model:
            decoder = cls(model, out_dtype=torch.float32) if device.type == "cuda" else None
        if decoder is not None:
            decoder.refresh()
            decoder._mark = (decoder.stats.captures, decoder.stats.capture_s)
        return decoder

    def report(self) -> str | None:
        """A line on the captures since :meth:`for_predict` marked this decoder; None if none."""
        captures, seconds = getattr(self, "_mark", (0, 0.0))
        if self.stats.captures == captures:
            return None
        return (f"CUDA graphs: captured {self.stats.captures - captures} bucket(s) in "
                f"{self.stats.capture_s - seconds:.2f} s ({len(self.graphs)} held, {self.stats.replays} replays, "
                f"{self.stats.eager} eager forwards)")  # fmt: skip

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def refresh(self) -> bool:
        """Puts the model's current weights where the graphs read them (see module docstring).

        If the model changed dtype, device or shapes (or its kernel switches) since the graphs were
        captured, every graph goes instead, to be captured again when needed; returns True then.
        """
        if self._bound is None:
            return False
        tensors = self._tensors()
        same = getattr(self.model, "fast_decoder", None) == self._flags and len(tensors) == len(self._bound)
        same = same and all(
            (t.dtype, t.device, t.shape) == (h.dtype, h.device, h.shape) for t, h in zip(tensors, self._bound)
        )
        if not same:
            self.close()
            return True
        with torch.no_grad():
            for t, held in zip(tensors, self._bound):
                if t.data_ptr() != held.data_ptr():
                    held.copy_(t)
                    t.data = held
        return False

    def close(self) -> None:
        """Frees the graphs and the weights they hold (the memory goes back to PyTorch's cache)."""
        self.graphs.clear()
        self.eager_buckets.clear()
        self._bound = None

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
            if self._bound is None:
                self._bound = [t.data for t in self._tensors()]
                self._flags = getattr(self.model, "fast_decoder", None)
            elif self.refresh():  # the model moved since the last capture (refresh was not called)
                self._bound = [t.data for t in self._tensors()]
            largest = self.buckets.largest(key[0])
            if largest != key and not any(k[0] == key[0] for k in self.graphs):
                # the largest first: the smaller captures of this batch size fit in its memory
                repeats = math.ceil(largest[1] / frames)
                self._capture(largest, codes.repeat(1, 1, repeats)[..., : largest[1]])
            return self._capture(key, codes)
        graph.codes[:batch, :, :frames].copy_(codes)
        graph.replay()
        self.stats.replays += 1
        return self._trimmed(graph.out, batch, frames)

    def decode_rows(self, codes: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Row ``i``'s waveform ``[1, output_length(lengths[i])]`` of right-padded ``codes [B, Q, T]``.

        The rows run in the groups of ``buckets.plan`` (one forward each, so the short rows of a
        batch are not padded to its longest), or all together while grad is enabled (eager anyway).
        Exact as any padding is: a row's samples depend on its own frames only.
        """
        groups = [list(range(len(lengths)))] if torch.is_grad_enabled() else self.buckets.plan(lengths)
        wavs: list[torch.Tensor] = [codes] * len(lengths)
        for rows in groups:
            if rows == list(range(rows[0], rows[-1] + 1)):
                sub = codes[rows[0] : rows[-1] + 1]  # a view: sorted batches give runs of rows
            else:
                sub = torch.cat([codes[i : i + 1] for i in rows])
            out = self(sub[..., : max(lengths[i] for i in rows)])
            for k, i in enumerate(rows):
                wavs[i] = out[k, :, : self.model.config.output_length(lengths[i])]
        return wavs

    def _capture(self, key: tuple[int, int], codes: torch.Tensor) -> torch.Tensor:
        batch, n_q, frames = codes.shape
        start = time.perf_counter()
        static = torch.zeros((key[0], n_q, key[1]), dtype=codes.dtype, device=codes.device)
        static[:batch, :, :frames].copy_(codes)
        # warm-up at the bucket's shape, which is also this batch's result
        result = self._trimmed(self._forward(static), batch, frames)
        try:
            replay, out = self.capture(lambda: self._forward(static))
        except torch.OutOfMemoryError:
            self.eager_buckets.add(key)
            log.warning("no CUDA graph for batch %d x %d frames: out of memory; it runs eagerly", *key)
            return result
        self.graphs[key] = _Graph(static, out, replay)
        self.stats.shapes.add(key)
        seconds = time.perf_counter() - start
        self.stats.captures += 1
        self.stats.capture_s += seconds
        log.info("captured CUDA graph for batch %d x %d frames in %.2f s (%d graphs)", *key, seconds, len(self.graphs))
        return result
