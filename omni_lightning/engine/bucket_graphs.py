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
``capture`` is injectable (``GraphCapture``; CUDA's is ``engine/cuda_capture.py``): the tests pass a
stand-in that records the callable, or fails, to run this logic on a CPU.

Graphs read the weights at the addresses they were captured with: :class:`BoundWeights` holds
those tensors (the convolution weights channels-last, :func:`conv_layout`) and a capture runs the
forward on them (``call``: every forward of the engine), wherever the parameters are. It never
repoints a parameter: the inference session (``runner/session.py``) lends these tensors to the
module's parameters during predict.
Not done: graphs are not shared across processes or devices.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from omni_lightning.engine.work import ForwardInputs

log = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """A capture failed (its cause chained); the bucket runs eagerly. Anything else a capture object
    raises (out of memory in its warm-up, say) happened before the capture and goes to the engine."""


class GraphCapture(Protocol):
    """Runs ``fn`` (a forward reading static inputs) once eagerly, then records it; returns
    ``(replay, static_output)``. Raises :class:`CaptureError` when the recording fails. It may also have
    ``reset()`` (later captures go to a new pool) and ``stale()`` (True when the graphs captured so far
    can no longer replay: the cache drops them)."""

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]: ...


@dataclass
class StepGraph:
    """One captured bucket: its static inputs (one buffer, ``ForwardInputs``' layout), output and replay."""

    inputs: torch.Tensor  # int64: codes, slot rows, valid frames (views below)
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
    device: torch.device  # where the static inputs live
    graphs: dict[tuple[int, int], StepGraph] = field(default_factory=dict)
    eager: set[tuple[int, int]] = field(default_factory=set)  # buckets whose capture failed
    stats: GraphStats = field(default_factory=GraphStats)
    autocast: torch.dtype | None = None  # what autocast ran the captured forwards in (None: off)

    def follow_autocast(self, device: torch.device) -> None:
        """Drops the graphs when autocast changed since they were captured: a replay runs the kernels
        (and dtypes) autocast chose at capture, whatever autocast does now."""
        now = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        if now != self.autocast:
            self.clear()
            self.autocast = now

    def get(self, inputs: ForwardInputs, scratch: int) -> StepGraph | None:
        """The graph of ``inputs``' bucket, captured now if it is new; None if it runs eagerly.

        Raises ``torch.OutOfMemoryError`` when the warm-up forward runs out of memory (the engine
        shrinks its buckets and plans again: nothing has changed)."""
        self.drop_if_stale()
        key = (inputs.rows, inputs.chunk)
        graph = self.graphs.get(key)
        if graph is not None or key in self.eager:
            return graph
        start = time.perf_counter()
        with torch.inference_mode(False):  # plain tensors: replays may come outside inference mode
            packed = torch.empty_like(inputs.packed, device=self.device)
            codes, rows, valid = inputs.views(packed)
            codes.copy_(inputs.views()[0])  # valid codes: warm-up and capture never look up a code out of range
            rows.fill_(scratch)
            valid.zero_()
        try:  # the warm-up runs on the scratch slot with no valid frame: no request's state moves
            replay, out = self.capture(lambda: self.forward(codes, rows, valid))
        except CaptureError as err:
            self.eager.add(key)
            self.stats.failures += 1
            log.warning(
                "no CUDA graph for %d rows x %d frames (%s); it runs eagerly", *key, str(err).splitlines()[0][:200]
            )
            return None
        graph = self.graphs[key] = StepGraph(packed, codes, rows, valid, out, replay)
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - start
        return graph

    def capture_largest_first(self, inputs: ForwardInputs, scratch: int, largest: int) -> None:
        """Before the first capture: the bucket of ``inputs``' rows and ``largest`` frames, so the captures
        after it fit in the memory it leaves in the shared pool (smallest first, each would add its own)."""
        if largest > inputs.chunk:
            codes = inputs.views()[0]
            codes = codes.repeat(1, 1, math.ceil(largest / inputs.chunk))[..., :largest]
            size = ForwardInputs.size(inputs.rows, inputs.codebooks, largest)
            packed = torch.cat((codes.reshape(-1), inputs.packed.new_zeros(size - codes.numel())))
            self.get(ForwardInputs(packed, inputs.rows, inputs.codebooks, largest), scratch)

    def run(self, graph: StepGraph, inputs: ForwardInputs) -> torch.Tensor:
        """Replays ``graph`` on ``inputs``, copied into its static inputs in one copy (from pinned host
        memory: not waited for)."""
        graph.inputs.copy_(inputs.packed, non_blocking=True)  # from pageable memory: a copy that waits
        graph.replay()
        self.stats.replays += 1
        return graph.out

    def drop_if_stale(self) -> None:
        """Drops every graph when the capture says the memory they recorded was freed since (``stale``:
        ``engine/cuda_capture.py``, after Lightning's end-of-run cleanup); the buckets are captured again."""
        stale = getattr(self.capture, "stale", None)
        if (self.graphs or self.eager) and stale is not None and stale():
            log.info("CUDA graphs dropped (the cuBLAS workspaces they recorded were freed): capturing again")
            self.clear()

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
    """The device tensors captured graphs read: the model's parameters and buffers, the convolution
    weights copied channels-last where asked. Does not repoint the model's parameters."""

    def __init__(self, model: nn.Module, conv_weights_channels_last: bool = False) -> None:
        self.model = model
        convs = conv_weights(model) if conv_weights_channels_last else set()
        names = [*(n for n, _ in model.named_parameters()), *(n for n, _ in model.named_buffers())]
        self._objects = self.tensors()
        with torch.no_grad():
            self.held = [conv_layout(t.detach()) if id(t) in convs else t.detach() for t in self._objects]
        self._by_name = dict(zip(names, self.held))
        self._held_ptrs = [h.data_ptr() for h in self.held]

    def tensors(self) -> list[torch.Tensor]:
        """The model's parameters and buffers, in the order of ``held``."""
        return [*self.model.parameters(), *self.model.buffers()]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.held)

    def call(self, *args: Any) -> Any:
        """``model(*args)`` reading the held tensors, wherever the model's parameters are."""
        if [t.data_ptr() for t in self._objects] == self._held_ptrs:  # lent to the parameters: no swap needed
            return self.model(*args)
        with _swap_lock(self.model):  # two engines over one model must not interleave their swaps
            return torch.func.functional_call(self.model, self._by_name, args)

    def refresh(self) -> bool:
        """Copies the model's current weights into the held tensors where they are other tensors.
        Returns False when the model changed dtype, device or shapes (its graphs then must go)."""
        tensors = self.tensors()
        if len(tensors) != len(self.held) or any(
            (t.dtype, t.device, t.shape) != (h.dtype, h.device, h.shape) for t, h in zip(tensors, self.held)
        ):
            return False
        self._objects = tensors
        with torch.inference_mode():  # held tensors made during a predict are inference tensors
            for t, held in zip(tensors, self.held):
                if t.data_ptr() != held.data_ptr():
                    held.copy_(t)
        return True


def conv_weights(model: nn.Module) -> set[int]:
    """Ids of the weights :func:`conv_layout` applies to: convolutions with a kernel longer than 1."""
    return {
        id(m.weight) for m in model.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)) and m.kernel_size[0] > 1
    }


_SWAP_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _swap_lock(model: nn.Module) -> threading.Lock:
    with _LOCKS_LOCK:
        return _SWAP_LOCKS.setdefault(model, threading.Lock())
