"""``PhaseProfiler``: when a predict run's phases began and ended, and where the loop's time went.

A Lightning profiler: Lightning itself calls ``start``/``stop`` around every hook, every step and every
batch fetch, so the phases are read from the run, not guessed from outside. For each action it keeps
the wall-clock time (``time.time()``) of its first start and last stop, its total duration and its
count; :meth:`phases` reads the predict phases from them:

- ``predict_start``: the module's ``on_predict_start`` began (trainer set up, weights on the device);
- ``first_batch``: the first ``predict_step`` began (the first batch was loaded and transferred);
- ``last_batch_end``: the last ``on_predict_batch_end`` hook returned;
- ``predict_end``: the module's ``on_predict_end`` returned;
- ``data_wait_s``: time the loop spent fetching batches (``[_PredictionLoop].predict_next``): what
  loading cost the engine, beyond what loader workers had ready.

What it does not do: synchronize the device (on CUDA a step's time is its launch time unless it
waits), print a summary (``describe`` is silent; the command line reports), or profile fit.
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.profilers import Profiler

FETCH_ACTION = "[_PredictionLoop].predict_next"


class PhaseProfiler(Profiler):
    """Per action: first start, last stop (wall clock), total seconds, count; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.actions: dict[str, dict[str, Any]] = {}
        self._open: dict[str, float] = {}

    def start(self, action_name: str) -> None:
        self._open[action_name] = time.perf_counter()
        if action_name not in self.actions:
            self.actions[action_name] = {"first_start": time.time(), "last_stop": None, "total_s": 0.0, "n": 0}

    def stop(self, action_name: str) -> None:
        began = self._open.pop(action_name, None)
        if began is None:
            return
        record = self.actions[action_name]
        record["total_s"] += time.perf_counter() - began
        record["n"] += 1
        record["last_stop"] = time.time()

    def summary(self) -> str:
        return ""

    def describe(self) -> None:
        """Prints nothing: the command line reports the phases (``--timings``)."""

    def _matching(self, prefix: str, suffix: str) -> list[dict[str, Any]]:
        return [r for name, r in self.actions.items() if name.startswith(prefix) and name.endswith(suffix)]

    def phases(self) -> dict[str, Any]:
        """Wall-clock times of the predict phases, plus ``data_wait_s`` and ``batches``."""

        def first(prefix: str, suffix: str) -> float | None:
            return min((r["first_start"] for r in self._matching(prefix, suffix)), default=None)

        def last(prefix: str, suffix: str) -> float | None:
            return max((r["last_stop"] for r in self._matching(prefix, suffix) if r["last_stop"]), default=None)

        steps = self._matching("[Strategy]", ".predict_step")
        fetch = self.actions.get(FETCH_ACTION, {})
        return {
            "predict_start": first("[LightningModule]", ".on_predict_start"),
            "first_batch": first("[Strategy]", ".predict_step"),
            "last_batch_end": last("[LightningModule]", ".on_predict_batch_end"),
            "predict_end": last("[LightningModule]", ".on_predict_end"),
            "data_wait_s": fetch.get("total_s", 0.0),
            "batches": sum(r["n"] for r in steps),
        }
