"""The progress bar where stdout is not a terminal (a log file, a pipe): plain lines, no ``\\r`` redraws.

A bar redrawn with ``\\r`` in a log file is one line of every update run together. There, :class:`LineTqdm`
writes the bar's state as a line of its own each tenth of its total and at its end (50 units apart where
the total is unknown; a bar that a terminal would clear, as a fit's validation's, only its last line),
and a fit says one line each tenth of its steps (:func:`train_line`).
``AudioProgressBar`` uses them where stdout does not redraw (:func:`redraws`).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

LINE_FORMAT = "{desc}{n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
PARTS = 10  # lines per bar (a fit's steps, a predict's audio seconds)
UNKNOWN_TOTAL_EVERY = 50


def redraws() -> bool:
    """Whether stdout shows a bar redrawn in place: a terminal, or a notebook (whose output renders ``\\r``)."""
    return sys.stdout.isatty() or type(sys.stdout).__module__.startswith("ipykernel")


class LineTqdm(Tqdm):
    """A Lightning ``Tqdm`` that prints its state as whole lines (see the module docstring); the same
    ``n``, ``total`` and ``postfix`` as the bar it stands for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._printed = 0.0  # n at the last line written
        self._silent = not kwargs.get("leave", True)  # a bar that would vanish (a fit's validation): its last line only
        kwargs["bar_format"] = LINE_FORMAT
        super().__init__(*args, **kwargs)

    def _due(self) -> bool:
        if not self.n:
            return False
        total = self.total
        if total and total != float("inf"):
            return int(PARTS * self.n / total) > int(PARTS * self._printed / total)
        return self.n - self._printed >= UNKNOWN_TOTAL_EVERY

    def _line(self) -> None:
        self.fp.write(self.__str__() + "\n")
        self.fp.flush()
        self._printed = self.n

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg is None and not self._silent and self._due():
            self._line()
        return False  # nothing to clear after: tqdm's close then writes no "\r"

    def clear(self, nolock: bool = False) -> None:
        pass  # a line once written stays (tqdm.write clears bars with "\r" before it writes)

    def reset(self, total: float | None = None) -> None:
        self._printed = 0.0
        super().reset(total)

    def close(self) -> None:
        if not self.disable and self.n and self.n != self._printed:
            self._line()  # the bar's last state
        self.leave = False  # tqdm's own close would redraw it and end the line
        super().close()


def line_every(trainer: Any) -> int:
    """Steps between a fit's lines: a tenth of ``max_steps``, else an epoch's batches (or 50)."""
    if trainer.max_steps and trainer.max_steps > 0:
        return max(1, math.ceil(trainer.max_steps / PARTS))
    batches = trainer.num_training_batches
    return int(batches) if batches and batches != float("inf") else UNKNOWN_TOTAL_EVERY


def train_line(trainer: Any, metrics: dict[str, Any], elapsed_s: float) -> str:
    """``Epoch 3, step 8/40 (35 s): train/loss=11.9, ...``: where a fit is, for a log file."""
    of = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
    values = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    return f"Epoch {trainer.current_epoch}, step {trainer.global_step}{of} ({elapsed_s:.0f} s)" + (
        f": {values}" if values else ""
    )
