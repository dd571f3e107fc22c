"""``TorchGraphCapture``: the decode engine's CUDA graph captures (``torch.cuda.graph``), one pool for all.

Warm-ups allocate from the graphs' pool too (``torch.cuda.use_mem_pool``, where this torch has it):
the blocks a warm-up frees are what its capture then takes, so a new bucket needs one forward's
memory, not two. Warm-ups and captures run on one side stream; the capture mode is ``thread_local``
(threads doing their own CUDA work meanwhile, a data loader pinning memory, must not break it).

What a dropped pool must not take with it (the out-of-memory fallback drops every graph and frees
their pool while the process goes on decoding):
- **library workspaces**: cuBLAS and cuBLASLt keep one workspace per (handle, stream), made on the
  stream's first GEMM by the caching allocator and held by torch until cleared. Made in a warm-up,
  the capture stream's would live in the graphs' pool, and every graph records its address. So it
  is made first, outside the pool (:meth:`TorchGraphCapture.prime_workspaces`), so a dropped pool
  never takes it. It is not cleared when graphs are dropped: ``torch._C._cuda_clearCublasWorkspaces``
  is process-wide, and other live graphs (another engine's, fit's step graph) recorded their streams'
  workspaces, so this is not done here.
- **a workspace cleared by someone else**: Lightning's CUDA accelerator clears every cuBLAS workspace
  and empties the cache at the end of each ``trainer`` run, so a graph kept for the next predict
  would write into freed memory (on an H200, the second of two predicts with a kept engine died with
  "unspecified launch failure"). The clears are counted (:func:`workspace_clears`: the torch function
  is wrapped, once, when the first capture object is made); graphs primed before the last clear are
  :meth:`~TorchGraphCapture.stale`, and the engine drops them and captures again.
- **a failed capture's state**: ``torch.cuda.graph`` leaves the capture stream current and the pool's
  allocation routing open when ``capture_end`` raises (later allocations on that stream would go to
  a pool being freed); both are undone here. The failed graph is kept alive (destroying it mid-run
  can leave the pool's bookkeeping unusable), later captures go to a fresh pool.
Not done: graphs shared across processes or devices; priming cuDNN (it keeps no workspace between
calls: a capture's own are the graph's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from omni_lightning.engine.bucket_graphs import CaptureError

_CLEARS = [0]  # calls of torch._C._cuda_clearCublasWorkspaces since it was wrapped


def workspace_clears() -> int:
    """How many times this process cleared torch's cuBLAS workspaces since :func:`count_workspace_clears`."""
    return _CLEARS[0]


def count_workspace_clears() -> None:
    """Wraps ``torch._C._cuda_clearCublasWorkspaces`` (once) so that every call through the attribute is
    counted: Lightning, torch's own utilities and users call it that way. A torch without it: nothing."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or getattr(clear, "counted", False):
        return

    def counted_clear(*args: Any, **kwargs: Any) -> Any:
        _CLEARS[0] += 1
        return clear(*args, **kwargs)

    counted_clear.counted = True  # type: ignore[attr-defined]
    torch._C._cuda_clearCublasWorkspaces = counted_clear


class TorchGraphCapture:
    """``torch.cuda.graph`` captures into one pool, warm-ups too (see the module docstring)."""

    def __init__(self) -> None:
        self.pool: Any = None
        self.stream: torch.cuda.Stream | None = None
        self.failed: list[torch.cuda.CUDAGraph] = []  # kept alive: see the module docstring
        self.primed_at: int | None = None  # workspace_clears() when the side stream's workspaces were made
        count_workspace_clears()

    @staticmethod
    def shares_warmup_memory() -> bool:
        return hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")

    def reset(self) -> None:
        """A new pool for the captures to come (the old one is freed with the graphs that held it). The
        library workspaces stay: primed outside the pool, they are not freed with it, and clearing them
        (process-wide) would free what other live graphs recorded (see the module docstring)."""
        self.pool = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        cached = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)  # a cast cached in the warm-up is freed when autocast exits
        try:
            return self._capture(fn)
        finally:
            torch.set_autocast_cache_enabled(cached)

    def stale(self) -> bool:
        """Whether the workspaces the graphs captured so far recorded were cleared since (see the module
        docstring): their replays would write into freed memory."""
        return self.primed_at is not None and self.primed_at != workspace_clears()

    def prime_workspaces(self) -> None:
        """One small GEMM of each kind (cuBLAS; cuBLASLt, a bias added) on the side stream, outside the
        graphs' pool: the workspaces torch keeps for this stream (whatever the dtype) are made in the
        regular pool. Again after they were cleared."""
        if self.primed_at != workspace_clears():
            with torch.cuda.stream(self.stream), torch.no_grad():
                a = torch.ones((16, 16), device="cuda")
                torch.mm(a, a)
                torch.addmm(a[0], a, a)
            self.primed_at = workspace_clears()

    def run_in_pool(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``fn()`` eagerly on the captures' stream, allocating from their pool where this torch can (a
        capture's warm-up): the blocks it frees are the ones the capture then takes."""
        if self.pool is None:
            self.pool = torch.cuda.MemPool() if self.shares_warmup_memory() else torch.cuda.graph_pool_handle()
        if self.stream is None:  # warm-ups and captures on one stream: the allocator reuses blocks per stream
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        self.prime_workspaces()
        try:
            with torch.cuda.stream(self.stream):
                if self.shares_warmup_memory():
                    with torch.cuda.use_mem_pool(self.pool):
                        return fn()
                return fn()
        except BaseException:
            self.stream.synchronize()  # nothing of a failed forward may still run when its memory is reused
            raise
        finally:
            torch.cuda.current_stream().wait_stream(self.stream)

    def _capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        self.run_in_pool(fn)
        pool_id = getattr(self.pool, "id", self.pool)
        graph, caller = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=pool_id, stream=self.stream, capture_error_mode="thread_local"):
                out = fn()
        except Exception as err:
            self._undo_failed_capture(caller, pool_id)
            self.failed.append(graph)
            self.pool = None
            raise CaptureError(f"{type(err).__name__}: {err}") from err
        return graph.replay, out

    def _undo_failed_capture(self, caller: torch.cuda.Stream, pool_id: Any) -> None:
        """What ``torch.cuda.graph`` leaves behind when ``capture_end`` raises: the capture stream still
        current, allocations on it still routed to the pool (see the module docstring)."""
        if torch.cuda.current_stream() != caller:
            torch.cuda.set_stream(caller)
        if isinstance(pool_id, tuple) and hasattr(torch._C, "_cuda_endAllocateToPool"):
            with contextlib.suppress(RuntimeError):  # raises where capture_end closed it: nothing to undo
                torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool_id)
        torch.cuda.synchronize()
