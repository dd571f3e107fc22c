"""CUDA graphs for the decode engine: one per ``(rows, chunk)`` bucket, captured lazily, one memory pool.

A graph replays a forward at fixed addresses: static inputs (codes, slot rows, valid frames), the
model's weights and the engine's ``DecodeState`` pool (read and written in place), and a static
output. Capturing a bucket first runs its forward once eagerly (cuDNN, cuBLAS and Triton pick and
load their kernels for that shape: those steps must not happen inside a capture), on the scratch
slot with no valid frames, so no request's state moves. Captures share one pool, warm-ups too: the
engine asks for its largest bucket first, whose freed blocks the later warm-ups and captures reuse.

When a capture fails (out of memory, or anything else a driver or library raises), that bucket runs
eagerly from then on and nothing more is captured into the pool it failed in: a failed capture can
leave the pool's bookkeeping unusable (CUDACachingAllocator asserts on the next capture into it),
so later captures get a fresh pool, and the failed graph object is kept, never destroyed mid-run.
``capture`` is injectable (``GraphCapture``): the tests pass a stand-in that records the callable,
or fails, to run this logic on a CPU.

Graphs read the weights at the addresses they were captured with. Lightning moves a module to the
GPU at every ``predict`` start (new tensors) and back at its end, so :meth:`BoundWeights.refresh`
copies the model's current weights into the tensors the graphs read and points the parameters back
at them: graphs survive from one predict call to the next and always see the current weights (after
fine-tuning too). The held convolution weights are channels-last: the decoder's activations are
time-major, so cuDNN would otherwise convert each weight at every call (:func:`conv_layout`; 20
weight copies per forward for qwen3-omni, ~0.17 ms of an H200's time per forward, seen in the
kernels of a 1-frame streaming step). The parameters read them in that layout while the engine
holds them; the move back to the host (``runner/host_weights.py``) writes them contiguous. Only the
decode engine asks for that layout, at its build, before any capture; fit's training graph binds its
weights after capturing and keeps their layout. Not done: graphs are not shared across processes or
devices.
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


class CaptureError(RuntimeError):
    """A capture failed (its cause chained); the bucket runs eagerly. Anything else a capture object
    raises (out of memory in its warm-up, say) happened before the capture and goes to the engine."""


class GraphCapture(Protocol):
    """Runs ``fn`` (a forward reading static inputs) once eagerly, then records it; returns
    ``(replay, static_output)``. Raises :class:`CaptureError` when the recording fails."""

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]: ...


class TorchGraphCapture:
    """``torch.cuda.graph`` captures into one pool, warm-ups too (see the module docstring).

    The warm-up allocates from the graphs' pool (``torch.cuda.use_mem_pool``, where this torch has
    it): its freed blocks are what the capture then takes, so a new bucket needs one forward's
    memory, not two. The capture mode is ``thread_local``: threads that do their own CUDA work
    meanwhile (a data loader pinning memory) must not break a capture, and never touch its stream.
    """

    def __init__(self) -> None:
        self.pool: Any = None
        self.stream: torch.cuda.Stream | None = None
        self.failed: list[torch.cuda.CUDAGraph] = []  # kept alive: see the module docstring

    @staticmethod
    def shares_warmup_memory() -> bool:
        return hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")

    def reset(self) -> None:
        """A new pool for the captures to come (the old one is freed with the graphs that hold it)."""
        self.pool = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        if self.pool is None:
            self.pool = torch.cuda.MemPool() if self.shares_warmup_memory() else torch.cuda.graph_pool_handle()
        if self.stream is None:  # warm-ups and captures on one stream: the allocator reuses blocks per stream
            self.stream = torch.cuda.Stream()
        pool_id = getattr(self.pool, "id", self.pool)
        self.stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(self.stream):
                if self.shares_warmup_memory():
                    with torch.cuda.use_mem_pool(self.pool):
                        fn()
                else:
                    fn()
        except BaseException:
            self.stream.synchronize()  # nothing of a failed warm-up may still run when its memory is reused
            raise
        finally:
            torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool_id, stream=self.stream, capture_error_mode="thread_local"):
                out = fn()
        except Exception as err:
            torch.cuda.synchronize()
            self.failed.append(graph)
            self.pool = None
            raise CaptureError(f"{type(err).__name__}: {err}") from err
        return graph.replay, out


@dataclass
class StepGraph:
    """One captured bucket: its static inputs, output and replay."""

    codes: torch.Tensor  # [rows, Q, chunk] int64
    rows: torch.Tensor  # [rows] int64 slot indices
    valid: torch.Tensor  # [rows] int64 real frames
    out: torch.Tensor  # [rows, 1, chunk * total_upsample]
    replay: Callable[[], Any]


@dataclass
class GraphStats:
    captures: int = 0
    capture_s: float = 0.0  # eager warm-up + capture, summed over buckets
    replays: int = 0
    eager: int = 0  # forwards that ran eagerly (long, or their capture failed)
    failures: int = 0


@dataclass
class GraphCache:
    """Captured forwards by bucket; ``forward(codes, rows, valid)`` runs the model on the engine's state."""

    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    capture: GraphCapture
    graphs: dict[tuple[int, int], StepGraph] = field(default_factory=dict)
    eager: set[tuple[int, int]] = field(default_factory=set)  # buckets whose capture failed
    stats: GraphStats = field(default_factory=GraphStats)

    def get(self, codes: torch.Tensor, scratch: int) -> StepGraph | None:
        """The graph of ``codes``' bucket, captured now if it is new; None if it runs eagerly.

        Raises ``torch.OutOfMemoryError`` when the warm-up forward runs out of memory (the engine
        shrinks its buckets and plans again: nothing has changed)."""
        key = (codes.shape[0], codes.shape[2])
        graph = self.graphs.get(key)
        if graph is not None or key in self.eager:
            return graph
        start = time.perf_counter()
        with torch.inference_mode(False):  # plain tensors: replays may come outside inference mode
            rows = torch.full((key[0],), scratch, dtype=torch.long, device=codes.device)
            valid = torch.zeros(key[0], dtype=torch.long, device=codes.device)
            static = codes.clone()  # valid codes: warm-up and capture never look up a code out of range
        try:  # the warm-up runs on the scratch slot with no valid frame: no request's state moves
            replay, out = self.capture(lambda: self.forward(static, rows, valid))
        except CaptureError as err:
            self.eager.add(key)
            self.stats.failures += 1
            log.warning("no CUDA graph for %d rows x %d frames (%s); it runs eagerly", *key,
                        str(err).splitlines()[0][:200])  # fmt: skip
            return None
        graph = self.graphs[key] = StepGraph(static, rows, valid, out, replay)
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - start
        return graph

    def run(self, graph: StepGraph, codes: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        graph.codes.copy_(codes)
        graph.rows.copy_(rows)
        graph.valid.copy_(valid)
        graph.replay()
        self.stats.replays += 1
        return graph.out

    def clear(self) -> None:
        """Drops every graph; later captures go to a new pool, so this one's memory can be freed."""
        self.graphs.clear()
        self.eager.clear()
        reset = getattr(self.capture, "reset", None)
        if reset is not None:
            reset()


def conv_layout(w: torch.Tensor) -> torch.Tensor:
    """A ``Conv1d`` or ``ConvTranspose1d`` weight ``[A, B, K]`` with its dim 1 innermost (strides
    ``(K * B, 1, B)``): the layers' ``unsqueeze`` then hands cuDNN a channels-last weight, as their
    time-major activations are, and cuDNN converts nothing."""
    return w if w.stride(1) == 1 else w.transpose(1, 2).contiguous().transpose(1, 2)


class BoundWeights:
    """The device tensors captured graphs read, kept across Lightning's moves (module docstring)."""

    def __init__(self, model: nn.Module, conv_weights_channels_last: bool = False) -> None:
        """``conv_weights_channels_last``: move the convolution weights to :func:`conv_layout` now
        (before any capture: a graph captured earlier would read the old tensors)."""
        self.model = model
        convs = {id(m.weight) for m in model.modules() if conv_weights_channels_last
                 and isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)) and m.kernel_size[0] > 1}  # fmt: skip
        self.held = []
        with torch.no_grad():
            for t in self._tensors():
                held = conv_layout(t.data) if id(t) in convs else t.data
                if held is not t.data:
                    t.data = held
                self.held.append(held)

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.held)

    def refresh(self) -> bool:
        """Puts the model's current weights where the graphs read them. Returns False when the model
        changed dtype, device or shapes since (graphs then must go: they read the old layout)."""
        tensors = self._tensors()
        if len(tensors) != len(self.held) or any(
            (t.dtype, t.device, t.shape) != (h.dtype, h.device, h.shape) for t, h in zip(tensors, self.held)
        ):
            return False
        with torch.no_grad():
            for t, held in zip(tensors, self.held):
                if t.data_ptr() != held.data_ptr():
                    held.copy_(t)
                    t.data = held
        return True
