"""The decode engine's life across ``predict`` calls, as a LightningModule mixin (``EngineOnPredict``).

The engine (``engine/engine.py``) is built at the first predict on a device and kept while it serves
the model where it is: its weights are refreshed, so its CUDA graphs survive from one predict to the
next. That holds under a ``gpu_memory_utilization`` cap too: the engine's weights, graphs and state
stay within the cap between predicts (what its forwards cached in the allocator is given back to the
GPU at each predict's end), so a server calling ``trainer.predict`` per batch of requests does not
capture its graphs again at every call (measured on an H200 under a 0.03 cap: ~0.17 s a call). The
next predict's move of the weights adds one copy of them for a moment (the engine then copies their
values into its own and frees the new ones). So when a predict starts (its ``setup`` hook, before
Lightning moves the weights) the kept engine is released if that copy would not fit in the cap beside
what the process holds, or if the predict's cap, device or dtype differs from the ones the engine was
built for: the move then finds the room it found before the engine was kept. A module setting
changed between predicts (``frames_per_forward``, ``fast_path``, ``graph_frames``) rebuilds it. The
engine is also released when the module starts another stage (fit, validate, test: their memory
comes first) or on ``module.release_engine()``. While fit runs, a decode from another thread (a
server sharing the module) is refused: the weights change at every step, and it would mix them.

A kept engine's weights are the parameters' values at the last predict's end (Lightning then copied
them to the host). Where no parameter was written to since (their version counters say so), the next
predict lends the parameters the engine's copies (``device_copies``, used by ``HostWeightsOnPredict``)
instead of moving them in and out again: two copies of the weights fewer per predict (~26 ms for
qwen3-omni's 412 MiB of bf16 weights on an H200), and no room needed for the move under a cap.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import lightning.pytorch as pl
import torch

from omni_lightning.engine import DecodeEngine
from omni_lightning.engine import budget as budgets
from omni_lightning.kernels import Kernels
from omni_lightning.runner.host_weights import CASTS


class EngineOnPredict:
    """LightningModule mixin: ``decode_engine()`` and the predict hooks that build, report and release
    it. The module declares ``engine``, ``engine_stats``, ``model``, ``frames_per_forward``, ``fast_path``
    and the ``graph_frames`` hyperparameter in its ``__init__``."""

    engine: DecodeEngine | None
    engine_stats: dict[str, float]
    model: Any
    frames_per_forward: int | None
    fast_path: bool

    def decode_engine(self) -> DecodeEngine:
        """The engine predict runs on: kept while it serves the model where it is (weights refreshed,
        so graphs survive across predict calls), else built for the model's device and dtype."""
        self._refuse_during_fit()
        cap, engine = self._predict_cap(), self.engine
        if engine is None or engine.model is not self.model or self._stale(engine, cap) or not engine.refresh():
            self.release_engine()
            self.engine = DecodeEngine(
                self.model, frames_per_forward=self.frames_per_forward, cuda_graphs=self.fast_path,
                graph_frames=self.hparams.graph_frames, gpu_memory_utilization=cap,
                kernels=None if self.fast_path else Kernels(inplace=True),
            )  # fmt: skip
            self._engine_built = (weakref.ref(self.engine), self._engine_settings())
        return self.engine

    def __getstate__(self) -> dict:
        # a copy or pickle of the module (deepcopy, torch.save, spawn) takes no engine: it holds device
        # buffers and graphs of this module's weights, and weak references, which cannot be pickled. A
        # copy kept the original's engine and its record of it, so settings changed on the copy were
        # ignored; it now builds its own at its first predict
        state = dict(super().__getstate__())
        state["engine"] = None
        for key in ("_engine_built", "_stamp", "_lendable", "_fit"):
            state.pop(key, None)
        return state

    def _predict_cap(self) -> float | None:
        return getattr(getattr(self._trainer, "predict_loop", None), "gpu_memory_utilization", None)

    def _engine_settings(self) -> tuple[Any, ...]:
        return self.frames_per_forward, self.fast_path, self.hparams.graph_frames

    def _stale(self, engine: DecodeEngine, cap: float | None) -> bool:
        """Whether ``engine`` was sized for another cap, or built by this module with settings changed
        since (say ``module.frames_per_forward = 512``); an engine a caller set by hand is not
        second-guessed on its settings."""
        built = getattr(self, "_engine_built", None)  # (a weak reference to the engine, its settings)
        changed = built is not None and built[0]() is engine and built[1] != self._engine_settings()
        return changed or engine.gpu_memory_utilization != cap

    def release_engine(self) -> None:
        """Frees the engine (its weights, graphs and state) and gives the cached memory back."""
        if self.engine is None:
            return
        cuda = self.engine.device.type == "cuda"
        self.engine.close()
        self.engine = None
        if cuda:
            torch.cuda.empty_cache()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":  # while it runs, decodes from other threads are refused (_refuse_during_fit)
            self._fit = (threading.get_ident(), weakref.ref(self._trainer) if self._trainer is not None else None)
        stamp, self._stamp, self._lendable = getattr(self, "_stamp", None), None, []
        engine = self.engine
        if engine is None:
            return
        if stage != "predict":  # fit, validate and test need the memory (and change or read the weights)
            self.release_engine()
            return
        trainer, cap = self._trainer, self._predict_cap()
        # where and in what dtype this predict runs the weights: an engine for another cannot serve it
        dtype = CASTS.get(str(getattr(trainer, "precision", ""))) or next(self.parameters()).dtype
        device = trainer.strategy.root_device if trainer is not None else engine.device
        if self._stale(engine, cap) or (device, dtype) != (engine.device, engine.dtype):
            self.release_engine()
            return
        self._lendable = self._current_copies(stamp)
        held = engine.weights.nbytes() if engine.weights is not None and not self._lendable else 0  # the move's copy
        if not budgets.room_for(engine.device, cap, held):
            self._lendable = []
            self.release_engine()  # before Lightning moves the weights in: their copy needs the room

    @property
    def trainer(self) -> pl.Trainer:
        return pl.LightningModule.trainer.fget(self)

    @trainer.setter
    def trainer(self, trainer: pl.Trainer | None) -> None:
        # Lightning attaches a trainer first thing in fit, validate, test and predict: a trainer.predict
        # on another thread during fit is refused here, before it changes the module (its trainer,
        # train/eval mode) under the running fit
        if trainer is not None and trainer is not getattr(self, "_trainer", None):
            self._refuse_during_fit()
        pl.LightningModule.trainer.fset(self, trainer)

    def _refuse_during_fit(self) -> None:
        """ValueError when ``trainer.fit`` runs on this module in another thread (a server sharing the
        module): the weights change at every step, so a decode would mix them. Once fit has returned
        or raised (its trainer's state says so), decodes run again."""
        thread, trainer_ref = getattr(self, "_fit", None) or (None, None)
        trainer = trainer_ref() if trainer_ref is not None else None
        if thread is None or thread == threading.get_ident() or trainer is None:
            return
        fitting = trainer.state.fn == "fit" and trainer.state.status == "running"  # str enums
        if fitting and trainer.lightning_module is self:  # (that trainer may fit another module since)
            raise ValueError("this module is being fine-tuned (trainer.fit, on another thread): its weights change at "
                             "every step, so a decode now would mix them. Decode once fit returns, or from a copy "
                             "made before it (copy.deepcopy(module))")  # fmt: skip

    def _current_copies(self, stamp: WeightStamp | None) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """The kept engine's weight tensors paired with the model's parameters, if ``stamp`` (taken at
        the last predict's end) shows that none was replaced, moved or written to since; else []."""
        engine = self.engine
        if stamp is None or engine is None or engine.weights is None or not stamp.holds(engine, self.model):
            return []
        params, held = list(self.model.parameters()), engine.weights.held
        if any((p.dtype, p.shape) != (h.dtype, h.shape) for p, h in zip(params, held)):
            return []
        return list(zip(params, held))

    def device_copies(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """For ``HostWeightsOnPredict``: the kept engine's copies of the model's weights, where they hold
        the parameters' current values (decided in ``setup``); asked once per predict."""
        pairs, self._lendable = getattr(self, "_lendable", []), []
        return pairs

    def on_predict_start(self) -> None:
        self.decode_engine()

    def on_predict_end(self) -> None:
        if self.engine is not None:
            self.engine_stats = self.engine.stats()
            self._stamp = self._stamp_weights(self.engine)
        if self.engine is not None and self.engine.device.type == "cuda":
            pl.utilities.rank_zero_info(self.engine.report())
            if self.engine.gpu_memory_utilization is not None:
                # a capped process: what the forwards cached goes back to the GPU's other tenants (the
                # engine's weights, graphs and state stay, within the cap)
                torch.cuda.empty_cache()

    def _stamp_weights(self, engine: DecodeEngine) -> WeightStamp | None:
        """A stamp of the parameters, taken when every one reads the engine's copy (else None)."""
        held = engine.weights.held if engine.weights is not None else []
        params = list(self.model.parameters())
        if not params or len(held) < len(params) or any(p.data_ptr() != h.data_ptr() for p, h in zip(params, held)):
            return None
        return WeightStamp(weakref.ref(engine), params)

    def cpu(self) -> Any:
        out = super().cpu()
        if getattr(self, "_stamp", None) is not None and not self._stamp.home():
            self._stamp = None  # written to between the predict's end and the move back, or not moved home
        return out


class WeightStamp:
    """The model's parameters at a predict's end, when they read the kept engine's copies: weak
    references, version counters, and (once ``cpu()`` has moved them home) their host addresses.
    While none is replaced, moved or written to, the engine's copies hold their values."""

    def __init__(self, engine: weakref.ref, params: list[torch.nn.Parameter]) -> None:
        self.engine = engine
        self.params = [weakref.ref(p) for p in params]  # a replaced model's weights are not kept alive
        self.versions = [p._version for p in params]
        self.host_ptrs: list[int] | None = None

    def _alive(self) -> list[torch.nn.Parameter] | None:
        params = [ref() for ref in self.params]
        if any(p is None or p._version != v for p, v in zip(params, self.versions)):
            return None
        return params  # type: ignore[return-value]

    def home(self) -> bool:
        """Notes where the parameters now are on the host (first call only); False if one was written
        to or is not on the CPU."""
        if self.host_ptrs is not None:
            return True
        params = self._alive()
        if params is None or any(p.device.type != "cpu" for p in params):
            return False
        self.host_ptrs = [p.data_ptr() for p in params]
        return True

    def holds(self, engine: DecodeEngine, model: torch.nn.Module) -> bool:
        """Whether ``engine``'s copies still hold ``model``'s parameters' values."""
        params = self._alive()
        return (self.engine() is engine and self.host_ptrs is not None and params is not None
                and [id(p) for p in params] == [id(p) for p in model.parameters()]
                and self.host_ptrs == [p.data_ptr() for p in params])  # fmt: skip
