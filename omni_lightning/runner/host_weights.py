"""Host memory for weights: page-locked buffers, one buffer packed with many tensors, and stamps.

Pure functions over tensors: they never repoint a parameter (``runner/session.py`` does that).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

ALIGN = 64  # bytes: every packed tensor starts at a multiple (any dtype's alignment)
CASTS = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}  # what Lightning casts to


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """``uint8[nbytes]`` of page-locked host memory."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def packable(tensors: list[torch.Tensor]) -> bool:
    """Whether :func:`pack` would gather ``tensors``: each one dense block on the CPU or a GPU, in more
    than one storage, none sharing memory with another."""
    if not tensors or any(t.device.type not in ("cpu", "cuda") or not dense(t) for t in tensors):
        return False
    storages = {(t.device, t.untyped_storage().data_ptr()) for t in tensors}
    return len(storages) == len(tensors) > 1


def pack(tensors: list[torch.Tensor], allocate: Callable[[int], torch.Tensor] = pinned_bytes) -> list[torch.Tensor]:
    """Contiguous copies of ``tensors`` (on the CPU, or on a GPU: copied back) as views of one host
    buffer from ``allocate``, each at a multiple of :data:`ALIGN`. Waits for copies from a GPU."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // ALIGN) * ALIGN
    flat = allocate(total)
    views = []
    with torch.no_grad():
        for t, start in zip(tensors, offsets):
            view = flat[start : start + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t, non_blocking=t.device.type == "cuda")  # from the device: one wait at the end
            views.append(view)
    for device in {t.device for t in tensors if t.device.type == "cuda"}:  # landed before anyone reads them
        torch.cuda.current_stream(device).synchronize()
    return views


def dense(t: torch.Tensor) -> bool:
    """One block of memory in some order of its dims (contiguous, or channels-last convolution weights)."""
    size = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.shape[d] != 1 and t.stride(d) != size:
            return False
        size *= t.shape[d]
    return True


def stamp(params: list[nn.Parameter]) -> list[tuple[weakref.ref, int, int]]:
    """The parameters' identities, version counters and addresses: while none changes, a copy of their
    values taken now still holds them."""
    return [(weakref.ref(p), p._version, p.data_ptr()) for p in params]


def unchanged(marks: list[tuple[weakref.ref, int, int]] | None, params: list[nn.Parameter]) -> bool:
    """Whether ``params`` are the stamped ones, unwritten and where they were (False for no stamp)."""
    return (
        marks is not None
        and len(marks) == len(params)
        and all(r() is p and (v, ptr) == (p._version, p.data_ptr()) for (r, v, ptr), p in zip(marks, params))
    )
