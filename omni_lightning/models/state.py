"""Per-request decoding state: what a ``Code2Wav`` forward needs to continue a request where its last
forward stopped (litgpt's ``KVCache``, for a codec decoder), and :class:`Step`, what one forward's
layers share.

The model is causal except for one look-ahead sample in each decoder transposed convolution, so a
request decoded chunk by chunk equals its whole decode when each chunk starts from the previous
chunk's state:
- each attention layer's keys (after RoPE, at absolute positions) and values of the last
  ``sliding_window - 1`` frames;
- each causal convolution's last ``(kernel - 1) * dilation`` input samples;
- each decoder transposed convolution's last input sample (its look-ahead, see ``layers.py``);
- ``pos``, the frames decoded so far.
The layers declare their state (``state_shapes``); nothing here knows the architecture.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from omni_lightning.kernels import Kernels


class Stateful(Protocol):
    """What a ``DecodeState`` is built for: a model that names its history's shapes (``Code2Wav``, which
    imports this module: the type is owned here, so nothing imports back up)."""

    def state_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


ALIGN = 16  # elements: where each named tensor starts in a slot's row (32 bytes in bf16, 64 in fp32)


class DecodeState:
    """The state of up to ``slots`` requests, one per slot; a fresh slot is all zeros.

    A forward with a state runs on ``rows`` (slot indices, one per batch row; default: every slot in
    order) and takes ``valid[b]`` real frames of row ``b`` (default: all). Frames past ``valid`` are
    padding: computed, never saved, so rows of different lengths share one forward exactly (the
    model is causal). ``select`` binds rows and valid counts; the tensors are shared, so a CUDA
    graph captured on a selection reads and writes the pool in place.

    Memory per slot (``bytes_per_slot``) does not depend on a request's length. All named tensors
    are views of one buffer (``flat``, a row per slot), so freeing slots is one kernel, and a forward
    reads its rows' state in one kernel and writes it back in one (:class:`Step`).
    """

    def __init__(
        self, model: Stateful, slots: int, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> None:
        if slots < 1:
            raise ValueError(f"a DecodeState needs at least one slot, got {slots}")
        ref = next(model.parameters())
        dtype, device = dtype or ref.dtype, torch.device(device) if device is not None else ref.device
        shapes = model.state_shapes()
        offsets, total = {}, 0
        for name, shape in shapes.items():  # each tensor starts ALIGN elements apart (vectorized kernels)
            offsets[name] = total
            total += -(-math.prod(shape) // ALIGN) * ALIGN
        self.columns = {name: (offsets[name], shape) for name, shape in shapes.items()}
        with torch.no_grad(), torch.inference_mode(False):  # plain tensors: updated under any mode
            # one buffer, a row per slot; each named tensor is a view of its columns, so a reset is one kernel
            self.flat = torch.zeros((slots, total), dtype=dtype, device=device)
            self.tensors = {name: columns(self.flat, name, self.columns) for name in shapes}
            self.pos = torch.zeros(slots, dtype=torch.long, device=device)
            # 0, 1, 2, ...: a history window's steps (Step._window), so a forward makes no arange per window
            self.steps = torch.arange(max((max(s) for s in shapes.values()), default=1), device=device)
        self.slots = slots
        self.rows: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None

    def select(self, rows: torch.Tensor, valid: torch.Tensor | None = None) -> DecodeState:
        """This state, for a forward on slots ``rows`` (int64 ``[B]``, on the state's device) with
        ``valid`` real frames each (int64 ``[B]``; None: every frame)."""
        view = copy.copy(self)
        view.rows, view.valid = rows, valid
        return view

    def reset(self, slots: Sequence[int] | None = None) -> None:
        """Makes ``slots`` (default: all) fresh."""
        with torch.no_grad(), torch.inference_mode(False):
            index = None if slots is None else host_to_device(list(slots), self.pos.device)
            for t in (self.flat, self.pos):  # every named tensor is a view of flat
                if index is None:
                    t.zero_()
                else:
                    t.index_fill_(0, index, 0)

    @property
    def bytes_per_slot(self) -> int:
        return self.flat[0].numel() * self.flat.element_size() + self.pos.element_size()


def columns(rows: torch.Tensor, name: str, layout: dict[str, tuple[int, tuple[int, ...]]]) -> torch.Tensor:
    """The named state tensor's view of ``rows [B, total]`` (a ``DecodeState.flat`` or a copy of its rows)."""
    start, shape = layout[name]
    return rows[:, start : start + math.prod(shape)].view(rows.shape[0], *shape)


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device`` without waiting for it: on CUDA through pinned memory
    and a non-blocking copy (a copy from pageable memory would make the host wait for the device)."""
    index = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


class Step:
    """What the layers of one forward share: the kernels, the rows' positions and histories, and the
    new histories, written to the state only when the forward completes (:meth:`commit`), so a
    forward that fails (out of memory, say) leaves every request's state as it was.

    The rows' state is read in one kernel (``rows``: a copy of their ``flat`` rows); a layer reads its
    history from that copy and writes its new history into the same columns of it (each layer reads
    its own history before it saves, and no other layer reads those columns), and :meth:`commit`
    writes the copy back in one kernel: two kernels for the whole state instead of two per tensor."""

    def __init__(
        self, state: DecodeState | None, kernels: Kernels, batch: int, frames: int, device: torch.device
    ) -> None:
        self.kernels, self.state, self.frames = kernels, state, frames
        self.rows = self.pos = self.valid = None
        self.fresh: torch.Tensor | bool = True  # no state: every row starts at frame 0
        if state is not None:
            if state.rows is None and batch != state.slots:
                raise ValueError(f"a batch of {batch} needs rows selected from the {state.slots}-slot state")
            self.rows = state.rows if state.rows is not None else torch.arange(batch, device=device)
            self.pos = state.pos.index_select(0, self.rows)
            self.fresh = self.pos == 0
            self.valid = state.valid
            with torch.no_grad():
                self._rows = state.flat.index_select(0, self.rows)
        self._windows: dict[tuple[int, int], torch.Tensor] = {}

    def history(self, name: str) -> torch.Tensor | None:
        """The rows' saved history of ``name`` (None without a state: zeros); a view, read before the
        layer's :meth:`save` of ``name`` overwrites it."""
        return None if self.state is None else columns(self._rows, name, self.state.columns)

    def save(self, name: str, buf: torch.Tensor, samples: int, dim: int = 1) -> None:
        """Queues the new history of ``name``: from ``buf`` (its history, then ``samples`` new steps
        along ``dim``, then maybe padding), the history-long window ending at each row's last real step."""
        if self.state is None:
            return
        target = columns(self._rows, name, self.state.columns)
        size = target.shape[dim]
        with torch.no_grad():  # the state carries values (commit)
            if self.valid is None:
                target.copy_(buf.narrow(dim, samples, size))
                return
            index = self._window(samples // self.frames, size)  # [B, size]
            shape = [1] * buf.dim()
            shape[0], shape[dim] = index.shape
            index = index.view(shape).expand(*buf.shape[:dim], size, *buf.shape[dim + 1 :])
            if buf.dtype == target.dtype:
                torch.gather(buf, dim, index, out=target)
            else:
                target.copy_(buf.gather(dim, index))

    def save_window(self, name: str, window: torch.Tensor) -> None:
        """Queues ``window`` (each row's new history of ``name``, as :meth:`save` would pick it) as it is: for
        a kernel that picks the windows itself (:meth:`window_ends`)."""
        if self.state is not None:
            with torch.no_grad():
                columns(self._rows, name, self.state.columns).copy_(window)

    def window_ends(self, samples: int) -> torch.Tensor | int:
        """Where each row's new history ends among ``samples`` new steps (:meth:`save`'s window): after its
        last real step, an int64 ``[B]``; ``samples`` where every step is real."""
        return samples if self.valid is None else self.valid * (samples // self.frames)

    def _window(self, per_frame: int, size: int) -> torch.Tensor:
        """Steps ``[valid * per_frame, + size)`` of each row: where its new history starts (shared by
        the layers of one forward that have the same rate and history length), one kernel each."""
        key = (per_frame, size)
        if key not in self._windows:
            # size is a dimension of a state tensor's shape: the state's steps cover it
            self._windows[key] = torch.add(self.state.steps[:size], self.valid[:, None], alpha=per_frame)
        return self._windows[key]

    def with_history(self, name: str, context: int, x: torch.Tensor) -> torch.Tensor:
        """``[B, context + T, C]``: ``name``'s history (or zeros), then ``x [B, T, C]``; saved."""
        if not context:
            return x
        past = self.history(name)
        if past is None:
            past = x.new_zeros(x.shape[0], context, x.shape[2])
        buf = torch.cat((past.to(x.dtype), x), dim=1)
        self.save(name, buf, x.shape[1])
        return buf

    def commit(self) -> None:
        """Writes the queued histories and advances the rows' positions. The state carries values, not
        gradients: a forward with a state under grad mode (a plain ``model(codes, state)`` call) returns
        audio with its graph, and the state it leaves is detached (no backward through earlier chunks)."""
        if self.state is None:
            return
        with torch.no_grad():
            self.state.flat.index_copy_(0, self.rows, self._rows)
            advance = self.valid if self.valid is not None else torch.full_like(self.rows, self.frames)
            self.state.pos.index_add_(0, self.rows, advance)
