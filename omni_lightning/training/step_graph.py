"""The generator's forward and backward in fine-tuning, replayed as CUDA graphs.

:class:`TrainingGraph` captures ``model(codes, kernels=...)`` and its backward for one batch shape
(``torch.cuda.make_graphed_callables``) and replays them for later batches of that shape: a step
launches two graphs instead of each kernel through autograd (``docs/performance.md``).

- One graph, for a batch shape (and trainable set) seen on two steps in a row, so an epoch's smaller
  last batch is not captured; a new shape seen twice replaces it, up to ``max_captures`` a fit.
  Other shapes and forwards without grad (validation) run eagerly.
- The graphs read the tensors the weights had at capture
  (:class:`~omni_lightning.engine.bucket_graphs.BoundWeights`); weights moved since are copied there and
  pointed back (``runner/session.point_at``); a change of dtype or shape drops the graph.
- A failed capture logs one warning and leaves the fit eager (a failed capture can spoil its pool).
- Allowed (:func:`training_graphs_allowed`): CUDA, a plain precision (autocast's weight cache cannot
  be captured), one process (graphed backwards under DDP's gradient hooks are untested), no
  gradient accumulation (the graph's gradients are static buffers a second backward would overwrite).

Not done: the losses, discriminators and optimizers stay eager. ``capture`` is injectable (tests).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from omni_lightning.engine.bucket_graphs import BoundWeights
from omni_lightning.kernels import Kernels
from omni_lightning.runner.session import point_at
from omni_lightning.training.schedule import plain_precision

log = logging.getLogger(__name__)

# (forward module, sample args) -> a callable with the module's forward, replayed from graphs
Capture = Callable[[nn.Module, tuple[torch.Tensor, ...]], Callable[..., torch.Tensor]]


class _Forward(nn.Module):
    """The model's forward with the training kernels bound: what is captured (codes in, waveform out)."""

    def __init__(self, model: nn.Module, kernels: Kernels) -> None:
        super().__init__()
        self.model = model
        self.kernels = kernels

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.model(codes, kernels=self.kernels)


def cuda_capture(forward: nn.Module, sample_args: tuple[torch.Tensor, ...]) -> Callable[..., torch.Tensor]:
    """``torch.cuda.make_graphed_callables``; then the warm-up's cached blocks go back to the device."""
    # thread_local: a data loader's pin-memory thread makes CUDA calls meanwhile (the decode engine's rule)
    if "capture_error_mode" in inspect.signature(torch.cuda.make_graphed_callables).parameters:
        graphed = torch.cuda.make_graphed_callables(
            forward, sample_args, allow_unused_input=True, capture_error_mode="thread_local"
        )
    else:  # an older torch captures with the graph context's default mode
        with thread_local_graphs():
            graphed = torch.cuda.make_graphed_callables(forward, sample_args, allow_unused_input=True)
    torch.cuda.empty_cache()  # the warm-up ran on a side stream: its freed blocks serve that stream only
    return graphed


@contextlib.contextmanager
def thread_local_graphs() -> Iterator[None]:
    """While it is open, ``torch.cuda.graph`` captures in ``thread_local`` mode unless told otherwise:
    for a ``make_graphed_callables`` that does not take ``capture_error_mode`` (torch before 2.12),
    which looks ``torch.cuda.graph`` up when it captures. Restored on the way out."""
    stock = torch.cuda.graph

    class ThreadLocalGraph(stock):
        def __init__(
            self, cuda_graph: Any, pool: Any = None, stream: Any = None, capture_error_mode: str = "thread_local"
        ) -> None:
            super().__init__(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode)

    torch.cuda.graph = ThreadLocalGraph
    try:
        yield
    finally:
        torch.cuda.graph = stock


def training_graphs_allowed(device: torch.device, precision_plugin: Any, world_size: int, accumulate: int) -> bool:
    """Whether fit may replay the generator as CUDA graphs (module docstring: why each condition)."""
    return device.type == "cuda" and plain_precision(precision_plugin) and world_size == 1 and accumulate == 1


class TrainingGraph:
    """Runs ``model(codes, kernels=kernels)``, from a CUDA graph where it can (module docstring)."""

    def __init__(self, capture: Capture = cuda_capture, max_captures: int = 4) -> None:
        self.capture, self.max_captures = capture, max_captures
        self.stats: dict[str, float] = {"captures": 0, "capture_s": 0.0, "replays": 0, "eager": 0}
        self.failed: str | None = None  # why the run is eager from now on
        self.capped = False  # max_captures reached: no new shapes captured
        self._graphed: Callable[..., torch.Tensor] | None = None
        self._key: tuple | None = None
        self._weights: BoundWeights | None = None
        self._last: tuple | None = None  # the key of the last step with grad

    def __call__(self, model: nn.Module, codes: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        if self.failed is not None or not torch.is_grad_enabled():  # (train/eval mode: the same forward)
            return self._eager(model, codes, kernels)
        key = (
            tuple(codes.shape),
            codes.dtype,
            codes.device,
            id(model),
            id(kernels),
            tuple(p.requires_grad for p in model.parameters()),
        )
        last, self._last = self._last, key
        if self._graphed is not None and key == self._key:
            if self._weights.refresh():  # moved weights copied where the graph reads them, and pointed there
                point_at(self._weights.tensors(), self._weights.held)
                self.stats["replays"] += 1
                return self._graphed(codes)
            self.drop()  # dtype or shapes changed: this graph reads a layout that is gone
        if key != last:  # captured only for a key seen on two steps in a row
            return self._eager(model, codes, kernels)
        if self.stats["captures"] >= self.max_captures:
            if not self.capped:
                self.capped = True
                log.info(
                    "fine-tuning: %d CUDA graph captures in this fit and the batch shapes keep changing; "
                    "new shapes run eagerly",
                    self.max_captures,
                )
            return self._eager(model, codes, kernels)
        self.drop()
        return self._capture(model, codes, kernels, key)

    def _eager(self, model: nn.Module, codes: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        self.stats["eager"] += 1
        return model(codes, kernels=kernels)

    def _capture(self, model: nn.Module, codes: torch.Tensor, kernels: Kernels, key: tuple) -> torch.Tensor:
        start = time.perf_counter()
        try:
            graphed = self.capture(_Forward(model, kernels), (codes,))
        except Exception as err:  # out of memory, an uncapturable operation, a library's refusal
            self.failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            log.warning(
                "fine-tuning: no CUDA graph for batch shape %s (%s); the run continues eagerly",
                list(codes.shape),
                self.failed,
            )
            return self._eager(model, codes, kernels)
        self._graphed, self._key, self._weights = graphed, key, BoundWeights(model)
        seconds = time.perf_counter() - start
        self.stats["captures"] += 1
        self.stats["capture_s"] += seconds
        log.info(
            "fine-tuning: generator forward and backward captured as CUDA graphs for batch shape %s in %.2f s",
            list(codes.shape),
            seconds,
        )
        self.stats["replays"] += 1
        return graphed(codes)

    def drop(self) -> None:
        """Forgets the graph (its memory is freed with it); a later batch may capture again."""
        self._graphed = self._key = self._weights = None
