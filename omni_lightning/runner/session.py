"""``InferenceSession``: the one owner of a module's device weights across predicts and streams.

It holds the module's :class:`~omni_lightning.engine.DecodeEngine` (kept while it serves the model where
it is, with its weights and state; its CUDA graphs are captured again after Lightning's end-of-run
cleanup frees the workspaces they recorded: ``engine/cuda_capture.py``), the parameters' host tensors
during predict, their stamp at the last predict's end and the module's streaming decoders. Only it
points a parameter elsewhere.

- ``setup("predict")``: holds the host tensors (one pinned buffer on CUDA); a kept engine that fits
  this predict lends its copies to the parameters (refreshed from the host where a parameter
  changed since the stamp), so Lightning's move copies nothing; an unfit engine is released.
- ``on_predict_start``: builds the engine if there is none (on CUDA the convolution weights channels-last
  first, so the engine reads the parameters' own tensors; outside a predict it copies them).
- ``on_predict_end``: the parameters back into their host tensors (copied only where written since
  lent, or cast), so Lightning's ``cpu()`` moves only buffers.
- ``setup`` of fit, validate or test releases the engine; fit retires the streaming decoders.

After an exception, :class:`ReleaseOnException` (a predict callback) puts the parameters back, copying
them. Not done: a ``trainer.predict`` on another thread while fit runs is refused in ``setup``, which
gives the fit back its trainer (for that moment the module names the predict's). A write through
``param.data`` between predicts changes no version counter: call ``module.release_engine()`` after it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from omni_lightning.engine import DecodeEngine, StreamingDecoder
from omni_lightning.engine.bucket_graphs import GraphCapture, conv_layout, conv_weights
from omni_lightning.kernels import Kernels
from omni_lightning.runner.host_weights import CASTS, pack, packable, pinned_bytes, stamp, unchanged

log = logging.getLogger(__name__)
Allocate = Callable[[int], torch.Tensor]  # bytes -> uint8 host buffer
FIT_ELSEWHERE = (
    "this module is being fine-tuned (trainer.fit, on another thread): its weights change at every step, so a "
    "decode now would mix them. Decode once fit returns, or from a copy made before it (copy.deepcopy(module))"
)
RETIRED = "its module started trainer.fit, which changes the weights its streams were decoded with"


def pack_parameters(params: list[nn.Parameter], allocate: Allocate = pinned_bytes) -> int:
    """Moves ``params``' values into one host buffer from ``allocate``, each parameter a contiguous view
    of it. Returns the bytes packed (0: packed already, sharing memory, not dense, or no memory)."""
    if not packable([p.data for p in params]):
        return 0
    try:
        views = pack([p.data for p in params], allocate)
    except RuntimeError as err:  # no page-locked memory to be had (a low `ulimit -l`, say)
        log.warning("host weights stay pageable: %s", str(err).splitlines()[0][:200])
        return 0
    for p, view in zip(params, views):
        p.data = view
    return sum(v.nbytes for v in views)


def point_at(tensors: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """Points each of ``tensors`` at its target, which holds its values (the caller vouches for that):
    fit's CUDA graph takes back the weights a move took elsewhere."""
    for t, target in zip(tensors, targets):
        if t.data_ptr() != target.data_ptr():
            t.data = target


class HostWeights:
    """A module's parameters' host tensors, held while the parameters are elsewhere (lent or moved)."""

    def __init__(self, pairs: list[tuple[nn.Parameter, torch.Tensor]], pin_cast: Allocate | None = None) -> None:
        self._pairs, self._pin_cast = pairs, pin_cast
        self._lent: dict[int, tuple[int, int]] = {}  # id(param) -> (data_ptr, _version) when lent

    @classmethod
    def hold(
        cls, module: nn.Module, pin: Allocate | None = None, pin_cast: Allocate | None = None
    ) -> HostWeights | None:
        """Holds ``module``'s parameters' host tensors (None if one is not on the CPU), first packed into
        one buffer from ``pin``. ``pin_cast``: at :meth:`restore`, packs parameters that changed dtype."""
        params = list(module.parameters())
        if not params or any(p.device.type != "cpu" for p in params):
            return None
        if pin is not None:
            pack_parameters(params, pin)
        return cls([(p, p.data) for p in params], pin_cast)

    def lend(self, param: nn.Parameter, device_copy: torch.Tensor) -> None:
        """Points ``param`` at ``device_copy``, which holds its values (the caller vouches for that)."""
        param.data = device_copy
        self._lent[id(param)] = (device_copy.data_ptr(), param._version)

    def restore(self) -> int:
        """Points every parameter back at its host tensor, copying its values in unless it was lent and
        not written since; a cast one is packed by ``pin_cast`` (else left where it is, contiguous).
        Returns how many came back. Releases what it held: a second call does nothing."""
        pairs, self._pairs, lent, self._lent = self._pairs, [], self._lent, {}
        moved, cast = 0, []
        with torch.no_grad():
            for param, host in pairs:
                data = param.data
                if data.data_ptr() == host.data_ptr():
                    continue
                if data.shape != host.shape or data.dtype != host.dtype:
                    cast.append(param)
                    continue
                if lent.get(id(param)) != (data.data_ptr(), param._version):  # moved, or written to since lent
                    host.copy_(data)
                param.data = host
                moved += 1
        if cast and self._pin_cast is not None:
            pack_parameters(cast, self._pin_cast)
        for param in cast:
            if not param.data.is_contiguous():
                param.data = param.data.contiguous()
        return moved


class ReleaseOnException(pl.Callback):
    """A failed predict's parameters go back into their held host tensors (before Lightning's ``cpu()``)."""

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        try:
            pl_module.session.release_held()
        except Exception as err:  # the predict's own exception is the one the caller must see
            log.error("after %s, the weights stay where they are: %s", type(exception).__name__, err)


class InferenceSession:
    """A module's engine, held host weights, stamp and streaming decoders. Methods take the module (no
    reference kept); a copy or pickle keeps only ``stats``. ``host_buffers`` and ``capture`` (makes a
    ``GraphCapture``) replace pinned memory and ``torch.cuda.graph`` (CUDA only) on any device: tests."""

    def __init__(self, host_buffers: Allocate | None = None, capture: Callable[[], GraphCapture] | None = None) -> None:
        self.host_buffers, self.capture = host_buffers, capture
        self.engine: DecodeEngine | None = None
        self.stats: dict[str, float] = {}  # the engine's stats() at the end of the last predict
        self.stream_decoder: StreamingDecoder | None = None  # module.stream's
        self._built: tuple[DecodeEngine, tuple] | None = None  # the engine this session built, its settings
        self._held: HostWeights | None = None
        self._stamp: list | None = None  # stamp() of the parameters when the engine's copies held them
        self._fit: tuple[int, weakref.ref | None] | None = None  # (thread, trainer) of the last fit
        self._decoders: weakref.WeakSet = weakref.WeakSet()  # a decoder the caller dropped is not kept

    def __getstate__(self) -> dict:
        return {"stats": dict(self.stats)}  # device buffers, graphs and weak references stay behind

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self.stats = state.get("stats", {})

    def decode_engine(self, module: Any) -> DecodeEngine:
        """The engine kept while it serves ``module.model`` where it is, else a new one for its device."""
        self.refuse_during_fit(module)
        cap, engine = _cap(module._trainer), self.engine
        stale = engine is None or engine.model is not module.model or self._stale(module, engine, cap)
        if stale or not engine.refresh():
            self.release_engine()
            held = self._held is not None  # a predict's weights, back into host tensors at its end: any layout
            self.engine = DecodeEngine(
                module.model, frames_per_forward=module.frames_per_forward, graph_frames=module.hparams.graph_frames,
                cuda_graphs=module.fast_path, capture=self._capture(module.model, module.fast_path and held),
                gpu_memory_utilization=cap, kernels=None if module.fast_path else Kernels(inplace=True),
            )  # fmt: skip
            self._built = (self.engine, _settings(module))
        return self.engine

    def release_engine(self) -> None:
        """Frees the engine (its weights, graphs and state) and gives the cached memory back."""
        engine, self.engine, self._built, self._stamp = self.engine, None, None, None
        if engine is not None:
            engine.close()
            if engine.device.type == "cuda":
                torch.cuda.empty_cache()

    def _stale(self, module: Any, engine: DecodeEngine, cap: float | None) -> bool:
        """Sized for another cap, or built here with other settings (one set by hand keeps its own)."""
        changed = self._built is not None and self._built[0] is engine and self._built[1] != _settings(module)
        return changed or engine.gpu_memory_utilization != cap

    def _capture(self, model: nn.Module, lay_out: bool) -> GraphCapture | None:
        """A new engine's capture (None: its default); with ``lay_out`` and graphs (on CUDA, or given ``capture``),
        the convolution weights go channels-last first (``conv_layout``): the engine holds them as they are."""
        if lay_out and (self.capture is not None or next(model.parameters()).device.type == "cuda"):
            convs = conv_weights(model)
            for p in model.parameters():
                if id(p) in convs and p.data.stride(1) != 1:  # (``.data``: no autograd record)
                    p.data = conv_layout(p.data)
        return self.capture() if self.capture is not None else None

    def setup(self, module: Any, stage: str) -> None:
        """Refuses a call on another thread during fit (giving the fit back its trainer); then per stage."""
        fit = self._fit_elsewhere(module)
        if fit is not None:
            module.trainer = fit
            raise ValueError(FIT_ELSEWHERE)
        self.release_held()
        marks, self._stamp, trainer = self._stamp, None, module._trainer
        if stage == "fit":
            self._fit = (threading.get_ident(), weakref.ref(trainer) if trainer is not None else None)
            for decoder in list(self._decoders):
                decoder.retire(RETIRED)
        if stage != "predict":
            self.release_engine()  # fit, validate and test need the memory (and change or read the weights)
            return
        params = list(module.parameters())
        device = trainer.strategy.root_device if trainer is not None else params[0].device
        cast = CASTS.get(str(getattr(trainer, "precision", "")))
        allocate = self.host_buffers or (pinned_bytes if device.type == "cuda" else None)
        pin = allocate is not None and all(cast is None or p.dtype == cast for p in params)
        self._held = HostWeights.hold(module, pin=allocate if pin else None, pin_cast=allocate)
        engine = self.engine
        if engine is None:
            return
        dtype = cast or params[0].dtype
        unfit = engine.model is not module.model or (device, dtype) != (engine.device, engine.dtype)
        if unfit or self._stale(module, engine, _cap(trainer)):
            self.release_engine()
            return
        self._lend(module.model, marks)

    def _lend(self, model: nn.Module, marks: list | None) -> None:
        """Points the parameters (and buffers) at the engine's copies, refreshed unless ``stamp`` holds."""
        weights, params = self.engine.weights, list(model.parameters())
        if weights is None or self._held is None or len(weights.held) < len(params):
            return
        copies = weights.held[: len(params)]
        if any(p.shape != c.shape for p, c in zip(params, copies)):
            return
        fresh = unchanged(marks, params)
        with torch.inference_mode():  # copies an engine built during a predict holds are inference tensors
            for p, c in zip(params, copies):
                if not fresh and p.data_ptr() != c.data_ptr():
                    c.copy_(p, non_blocking=p.is_pinned())  # a parameter may have changed since
                self._held.lend(p, c)
        slots = [(m, name) for m in model.modules() for name, b in m._buffers.items() if b is not None]
        for (owner, name), c in zip(slots, weights.held[len(params) :]):  # (buffers: moved by Lightning, not held)
            if (owner._buffers[name].shape, owner._buffers[name].dtype) == (c.shape, c.dtype):
                owner._buffers[name] = c  # what a move would copy: the forwards read the engine's tensors

    def on_predict_end(self, module: Any) -> None:
        """Stats, the parameters back into their host tensors, the stamp, the engine's report."""
        engine, params = self.engine, list(module.model.parameters())
        copies = engine.weights.held if engine is not None and engine.weights is not None else []
        lent = len(copies) >= len(params) and all(p.data_ptr() == c.data_ptr() for p, c in zip(params, copies))
        self.release_held()
        if engine is None:
            return
        self.stats = engine.stats()
        self._stamp = stamp(params) if lent and all(p.device.type == "cpu" for p in params) else None
        if engine.device.type == "cuda":
            pl.utilities.rank_zero_info(engine.report())
            if engine.gpu_memory_utilization is not None:
                torch.cuda.empty_cache()  # what the forwards cached goes back to the GPU's other tenants

    def release_held(self) -> None:
        """The parameters back into the host tensors held (a no-op when none are)."""
        held, self._held = self._held, None
        if held is not None:
            with torch.inference_mode(False):  # (on_predict_end runs in it) what is packed must stay trainable
                held.restore()

    def _fit_elsewhere(self, module: Any) -> pl.Trainer | None:
        """The trainer of a fit running on ``module`` in another thread, else None."""
        thread, ref = self._fit or (None, None)
        trainer = ref() if ref is not None else None
        if thread is None or thread == threading.get_ident() or trainer is None:
            return None
        fitting = trainer.state.fn == "fit" and trainer.state.status == "running"
        return trainer if fitting and trainer.lightning_module is module else None

    def refuse_during_fit(self, module: Any) -> None:
        """ValueError while ``trainer.fit`` runs on ``module`` in another thread (its weights change)."""
        if self._fit_elsewhere(module) is not None:
            raise ValueError(FIT_ELSEWHERE)

    def streaming_decoder(self, module: Any, max_streams: int, cuda_graphs: bool,
                          gpu_memory_utilization: float | None, step_frames: int = 16) -> StreamingDecoder:  # fmt: skip
        """A decoder over ``module.model``, retired when the module starts fit."""
        self.refuse_during_fit(module)
        graphs = cuda_graphs and module.fast_path  # laid out in place: a stream never refreshes copies
        decoder = StreamingDecoder(module.model, max_streams, graphs, capture=self._capture(module.model, graphs),
                                   gpu_memory_utilization=gpu_memory_utilization, step_frames=step_frames)  # fmt: skip
        self._decoders.add(decoder)
        return decoder

    def stream(self, module: Any, code_chunks: Iterable[torch.Tensor], cuda_graphs: bool) -> Iterator[torch.Tensor]:
        """One request's audio chunk by chunk, on a decoder of 8 streams kept for the next call."""
        self.refuse_during_fit(module)
        decoder = self.stream_decoder
        if decoder is None or decoder.retired or decoder.cuda_graphs != cuda_graphs or not decoder.reads(module.model):
            decoder = self.stream_decoder = self.streaming_decoder(module, 8, cuda_graphs, None)
        yield from decoder.stream(code_chunks)


def _cap(trainer: Any) -> float | None:
    return getattr(getattr(trainer, "predict_loop", None), "gpu_memory_utilization", None)


def _settings(module: Any) -> tuple:
    return module.frames_per_forward, module.fast_path, module.hparams.graph_frames
