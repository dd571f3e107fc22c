"""Moving a module's weights back to the CPU after predict into the memory they came from.

Lightning moves the module to the accelerator when ``predict`` starts and back to the CPU when it
ends (``Strategy.teardown`` calls ``module.cpu()``), so a job of many ``predict`` calls moves the
weights both ways every time. The way back allocates a new host tensor per parameter and faults in
every page of it: on an H200 host that was 0.31 s for qwen3-omni's 432 MB of bf16 weights, an eighth
of a 6,000 s predict (docs/performance.md). The host tensors the weights had before the move are
still the right size and already resident; :class:`HostWeights` keeps them during the run and, at
the move back, copies the current values into them and points the parameters there.

The values are always copied (whatever changed them during the run, the host gets the current
ones). A parameter whose shape, dtype or identity changed during the run (a precision plugin's cast
on the first predict, a replaced parameter) is left to the stock move. Buffers are left to it too:
``nn.Module._apply`` replaces buffer objects, so there is no held tensor to match them to, and they
are small. Only predict holds weights: the host copies stay allocated during the run (as they would
before it), and a fit's changed weights are better written to new memory than into tensors a
caller's earlier ``state_dict()`` may still share.

On CUDA the held tensors are first packed into one buffer of page-locked memory (:func:`pack`,
once: later predicts find them packed), so both moves run at the copy engines' speed. Measured on an
H200 host for qwen3-omni's 412 MiB of bf16 weights: to the GPU 82.6 ms from pageable memory, 14.2 ms
from pinned; back into pinned held tensors 11.7 ms, where the stock move took 268 ms. The cost: the
weights' host memory is page-locked while the module holds it (rounded up to a power of two by
PyTorch's pinned allocator), and the first predict of a module pays one copy of them on the host.
Weights that a precision plugin casts (``bf16-true`` over fp32 weights: the cast replaces them)
are not packed on the way in; on the way back they are copied from the device straight into one new
pinned buffer, so the next predict finds them packed and the one-time cost falls on the predict that
cast them, not on the first warm one (measured on the H200 before this: 0.28 s of set-up in that
predict against 0.03 s in the next). Not packed: weights sharing memory (tied views).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)
ALIGN = 64  # bytes: every weight's view starts at a multiple (any dtype's alignment)


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """``uint8[nbytes]`` of page-locked host memory."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def pack(params: list[nn.Parameter], allocate: Callable[[int], torch.Tensor] = pinned_bytes) -> int:
    """Moves the weights of ``params`` (on the CPU, or on a GPU: copied back) into one host buffer from
    ``allocate`` (pinned memory by default), values kept: each parameter's data becomes a view of it.
    Returns the bytes packed (0 when they share one buffer already, share memory with each other, or
    none is one dense block: contiguous or with its dims in another order)."""
    todo = [p for p in params if p.device.type in ("cpu", "cuda") and _dense(p.data)]
    storages = {(p.device, p.data.untyped_storage().data_ptr()) for p in todo}
    if not todo or len(storages) == 1 or len(storages) < len(todo):  # packed, or weights sharing memory
        return 0
    offsets, total = [], 0
    for p in todo:
        offsets.append(total)
        total += -(-p.data.nbytes // ALIGN) * ALIGN
    flat = allocate(total)
    devices = {p.device for p in todo if p.device.type == "cuda"}
    with torch.no_grad():
        for p, start in zip(todo, offsets):
            view = flat[start : start + p.data.nbytes].view(p.dtype).view(p.shape)
            view.copy_(p.data, non_blocking=p.device.type == "cuda")  # from the device: one wait at the end
            p.data = view
    for device in devices:  # the copies land before anyone reads the host tensors
        torch.cuda.current_stream(device).synchronize()
    return total


def _dense(t: torch.Tensor) -> bool:
    """One block of memory in some order of its dims (contiguous, or the decode engine's convolution
    weights with their channels innermost)."""
    size = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.shape[d] != 1 and t.stride(d) != size:
            return False
        size *= t.shape[d]
    return True


class HostWeights:
    """The host tensors of a module's parameters, held while the module runs elsewhere."""

    def __init__(self, pairs: list[tuple[nn.Parameter, torch.Tensor]],
                 pin_cast: Callable[[int], torch.Tensor] | None = None) -> None:  # fmt: skip
        self._pairs = pairs
        self._pin_cast = pin_cast
        self._lent: dict[int, tuple[int, int]] = {}  # id(param) -> (device data_ptr, param._version) when lent

    @classmethod
    def hold(cls, module: nn.Module, pin: Callable[[int], torch.Tensor] | None = None,
             pin_cast: Callable[[int], torch.Tensor] | None = None) -> HostWeights | None:  # fmt: skip
        """Holds ``module``'s parameters' host tensors; None if any parameter is not on the CPU.
        ``pin``: first :func:`pack` them into one buffer it allocates (``pinned_bytes`` on CUDA).
        ``pin_cast``: at :meth:`restore`, pack the parameters that changed dtype or shape meanwhile (a
        precision plugin's cast) into one buffer it allocates, straight from where they are."""
        params = list(module.parameters())
        if not params or any(p.device.type != "cpu" for p in params):
            return None
        if pin is not None:
            _pack_or_warn(params, pin)
        return cls([(p, p.data) for p in params], pin_cast)

    def lend(self, param: nn.Parameter, device_copy: torch.Tensor) -> None:
        """Points ``param`` at ``device_copy``, a tensor elsewhere that holds the same values as its
        host tensor (the caller vouches for that), so the move to that device has nothing to copy.
        :meth:`restore` then points it back without copying unless something wrote to it meanwhile."""
        param.data = device_copy
        self._lent[id(param)] = (device_copy.data_ptr(), param._version)

    def restore(self) -> int:
        """Copies every moved parameter's values into its held host tensor and points it there;
        returns how many moved. Parameters that changed dtype or shape are packed by ``pin_cast`` if
        given, else left where they are; lent ones that nothing wrote to are pointed back uncopied.
        Releases what it held: a second call does nothing."""
        pairs, self._pairs, lent, self._lent = self._pairs, [], self._lent, {}
        moved, cast = 0, []
        with torch.no_grad():
            for param, host in pairs:
                data = param.data
                if data.data_ptr() == host.data_ptr():
                    continue
                if lent.get(id(param)) == (data.data_ptr(), param._version):  # unchanged since lent
                    param.data = host
                    moved += 1
                    continue
                if data.shape != host.shape or data.dtype != host.dtype:
                    cast.append(param)
                    continue
                host.copy_(data)
                param.data = host
                moved += 1
        if cast and self._pin_cast is not None:
            _pack_or_warn(cast, self._pin_cast)
        return moved


def _pack_or_warn(params: list[nn.Parameter], allocate: Callable[[int], torch.Tensor]) -> None:
    try:
        pack(params, allocate)
    except RuntimeError as err:  # no page-locked memory to be had (a low `ulimit -l`, say)
        log.warning("host weights stay pageable: %s", str(err).splitlines()[0][:200])


CASTS = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}  # what Lightning casts to


class HostWeightsOnPredict:
    """LightningModule mixin (first base): during ``predict`` it holds the parameters' host tensors
    from the ``setup`` hook (before Lightning moves the module) and ``cpu()`` restores into them.
    ``Code2WavModule`` has it; any LightningModule can take it. A module that keeps copies of its
    weights on the device across predicts defines ``device_copies()``: (parameter, device tensor)
    pairs whose values are the parameter's; those parameters are lent their copy instead of moved."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        trainer = self._trainer
        cuda = trainer is not None and trainer.strategy.root_device.type == "cuda"
        # a precision plugin about to cast the weights replaces them: pinning those would be wasted
        cast = CASTS.get(str(getattr(trainer, "precision", "")))
        pin = cuda and all(cast is None or p.dtype == cast for p in self.parameters())
        self._host_weights = (
            HostWeights.hold(self, pin=pinned_bytes if pin else None, pin_cast=pinned_bytes if cuda else None)
            if stage == "predict" else None
        )  # fmt: skip
        copies = getattr(self, "device_copies", None)
        pairs = copies() if copies is not None else []
        if self._host_weights is not None:
            for param, device_copy in pairs:
                self._host_weights.lend(param, device_copy)

    def cpu(self) -> Any:
        held, self._host_weights = getattr(self, "_host_weights", None), None
        if held is not None:
            held.restore()
        return super().cpu()
