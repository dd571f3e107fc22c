"""A request's frames in flight through the decode engine: what a forward takes from them, what it
gives back, and how a forward's inputs reach the device.

``Work`` holds one slot's frames (on the device for batch decode; a streaming step's chunks stay where
they came, the host) and the samples decoded so far. :func:`gather` builds a forward's inputs from the
works it advances: its codes ``[rows, Q, chunk]``, each row's slot and valid frames, packed in one int64
buffer (:class:`ForwardInputs`). Built on the host, where a streaming step's chunks are, the buffer is
pinned and reaches the device in one copy that the host does not wait for, straight into a CUDA graph's
static inputs (a step's chunks, its rows and valid counts: one copy, not one each plus a gather
kernel). :func:`scatter` puts a forward's output where each work keeps its samples (a copy per work,
or one multi-tensor copy for all when the forward decodes every one of them whole: a streaming step).
Nothing here waits for the device, but :func:`checked_lengths` (a batch's checks before it becomes
work) asked to check codes on a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

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


@dataclass
class ForwardInputs:
    """A forward's inputs in one int64 buffer ``packed``: codes ``[rows, Q, chunk]``, then each row's slot,
    then its valid frames (padding rows: the scratch slot, 0 frames). :meth:`views` unpacks any buffer of
    this layout (a CUDA graph's static inputs are one)."""

    packed: torch.Tensor
    rows: int
    codebooks: int
    chunk: int

    @staticmethod
    def size(rows: int, codebooks: int, chunk: int) -> int:
        return rows * codebooks * chunk + 2 * rows

    def views(self, packed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes, slots, valid)`` of ``packed`` (default: this buffer), views of it."""
        packed = self.packed if packed is None else packed
        n = self.rows * self.codebooks * self.chunk
        codes = packed[:n].view(self.rows, self.codebooks, self.chunk)
        return codes, packed[n : n + self.rows], packed[n + self.rows : n + 2 * self.rows]

    def to(self, device: torch.device) -> ForwardInputs:
        """On ``device`` in one copy (from pinned memory: not waited for); itself where it is there."""
        if self.packed.device == device:
            return self
        return replace(self, packed=self.packed.to(device, non_blocking=True))  # pageable: a copy that waits


def gather(
    picked: Sequence[Work], take: Sequence[int], rows: int, chunk: int, slots: Sequence[int], device: torch.device
) -> ForwardInputs:
    """The forward's inputs: ``take[r]`` frames of ``picked[r]`` from where it stands, zeros after them and
    in the padding rows; ``slots`` per row (the padding rows' too). On the host when every work's codes are
    there (pinned for a CUDA ``device``: one copy takes it there), else on the works' device."""
    host = all(w.codes.device.type == "cpu" for w in picked)
    q, n = picked[0].codes.shape[0], rows * picked[0].codes.shape[0] * chunk
    meta = torch.tensor([*slots, *take, *[0] * (rows - len(take))], dtype=torch.long)
    if host:  # pinned for a CUDA device: the forward's one copy is not waited for
        packed = torch.empty(n + 2 * rows, dtype=torch.long, pin_memory=device.type == "cuda")
    else:  # the rows and valid counts from pinned memory: a pageable copy would wait for the device
        packed = torch.empty(n + 2 * rows, dtype=torch.long, device=picked[0].codes.device)
        meta = meta.pin_memory() if packed.is_cuda else meta
    inputs = ForwardInputs(packed, rows, q, chunk)
    if host and len(picked) == rows and all(t == chunk for t in take):  # every row whole: one host copy
        torch.cat([*(w.codes[:, w.done : w.done + chunk].reshape(-1) for w in picked), meta], out=packed)
        return inputs
    packed[n:].copy_(meta, non_blocking=True)
    codes, _, _ = inputs.views()
    if len(picked) == rows and all(t == chunk for t in take):
        torch.stack([w.codes[:, w.done : w.done + chunk] for w in picked], out=codes)
    else:
        codes.zero_()
        for r, (w, t) in enumerate(zip(picked, take)):
            codes[r, :, :t] = w.codes[:, w.done : w.done + t]
    return inputs


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
        # one cast for all rows (a multi-tensor copy is fast on one dtype); a lone row is cast by its copy
        src = out if out.dtype == dtype or len(picked) == 1 else out.to(dtype)
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
