"""A request's frames in flight through the decode engine: what a forward takes from them, what it
gives back, and how a streaming step's chunks reach the device.

``Work`` holds one slot's frames (on the device) and the samples decoded so far. :func:`gather`
builds a forward's ``[rows, Q, chunk]`` codes from the works it advances; :func:`scatter` puts that
forward's output where each work keeps its samples (a copy per work, or one multi-tensor copy for all
when the forward decodes every one of them whole: a streaming step).
:func:`to_device` moves many small chunks in one copy. Nothing here waits for the device, but
:func:`checked_lengths` (a batch's checks before it becomes work) asked to check codes on a device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from omni_lightning.models.codes import check_lengths, validate_codes
from omni_lightning.models.config import Code2WavConfig


@dataclass
class Work:
    """Frames for one slot: ``codes [Q, n]`` on the device, decoded into ``out`` as they go (``out``
    is made at the first forward that reaches it)."""

    slot: int
    codes: torch.Tensor
    fresh: bool  # the slot is at frame 0: its first `tail` samples are dropped
    samples: int  # samples out will hold
    out: torch.Tensor | None = None
    done: int = 0  # frames decoded
    written: int = 0  # samples written to out

    @property
    def left(self) -> int:
        return self.codes.shape[1] - self.done


def checked_lengths(
    codes: torch.Tensor, lengths: Sequence[int] | None, config: Code2WavConfig, validate: bool | None
) -> list[int]:
    """A batch's lengths as ints after ``DecodeEngine.decode``'s checks; a batch of no request passes."""
    if isinstance(codes, torch.Tensor) and codes.dim() == 3 and codes.shape[0] == 0:
        return check_lengths(lengths, 0, codes.shape[-1]).tolist()
    values = validate or (validate is None and isinstance(codes, torch.Tensor) and codes.device.type == "cpu")
    return validate_codes(codes, config, lengths, values=bool(values)).tolist()


def to_device(
    chunks: Sequence[torch.Tensor], device: torch.device, move: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Each ``[Q, n]`` chunk as int64 on ``device``; on CUDA, the CPU ones in one copy through pinned
    memory that the host does not wait for (a pageable copy per chunk would wait for the device each
    time). ``move`` replaces that copy of the one flat int64 buffer (tests run it on a CPU)."""
    out: list[torch.Tensor | None] = [c if c.device == device else None for c in chunks]
    moving = [i for i, c in enumerate(out) if c is None]
    batched = move is not None or device.type == "cuda"
    if moving and batched and all(chunks[i].device.type == "cpu" for i in moving):
        move = move or (lambda flat: flat.pin_memory().to(device, non_blocking=True))
        flat = move(torch.cat([chunks[i].reshape(-1).long() for i in moving]))
        for i, piece in zip(moving, flat.split([chunks[i].numel() for i in moving])):
            out[i] = piece.view(chunks[i].shape)
    return [c if c is not None else chunks[i].to(device) for i, c in enumerate(out)]


def gather(picked: Sequence[Work], take: Sequence[int], rows: int, chunk: int, device: torch.device) -> torch.Tensor:
    """The forward's codes ``[rows, Q, chunk]``: ``take[r]`` frames of ``picked[r]`` from where it
    stands, zeros after them and in the padding rows (one kernel when every row is full)."""
    if len(picked) == rows and all(t == chunk for t in take):
        return torch.stack([w.codes[:, w.done : w.done + chunk] for w in picked])
    codes = torch.zeros((rows, picked[0].codes.shape[0], chunk), dtype=torch.long, device=device)
    for r, (w, t) in enumerate(zip(picked, take)):
        codes[r, :, :t] = w.codes[:, w.done : w.done + t]
    return codes


def scatter(
    out: torch.Tensor,
    picked: Sequence[Work],
    take: Sequence[int],
    up: int,
    tail: int,
    dtype: torch.dtype,
    together: bool,
) -> None:
    """Row ``r`` of a forward's output ``[rows, 1, chunk * up]`` to ``picked[r]`` (its first ``tail``
    samples dropped at a fresh slot's start); each work moves on by ``take[r]`` frames. ``together``:
    when the forward decodes every work whole, all their samples go in one multi-tensor copy, each into
    storage of its own, so a stream's output never keeps the step's other rows alive."""
    if together and all(w.done == 0 and t == w.left for w, t in zip(picked, take)):
        src = out if out.dtype == dtype else out.to(dtype)  # one cast for all rows
        starts = [tail if w.fresh else 0 for w in picked]
        for w, t, start in zip(picked, take, starts):
            w.out = torch.empty((1, t * up - start), dtype=dtype, device=out.device)
        rows = [src[r, :, start : start + w.out.shape[1]] for r, (w, start) in enumerate(zip(picked, starts))]
        torch._foreach_copy_([w.out for w in picked], rows)
        for w, t in zip(picked, take):
            w.written, w.done = w.out.shape[1], w.done + t
        return
    for r, (w, t) in enumerate(zip(picked, take)):
        start = tail if w.fresh and w.done == 0 else 0
        n = t * up - start
        if w.out is None:
            w.out = torch.empty((1, w.samples), dtype=dtype, device=out.device)
        w.out[:, w.written : w.written + n].copy_(out[r, :, start : start + n])
        w.written += n
        w.done += t
