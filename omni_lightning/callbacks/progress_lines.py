"""The progress bar where stdout is not a terminal (a log file, a pipe): plain lines, no ``\\r`` redraws.

A bar redrawn with ``\\r`` in a log file is one line of every update run together. There, a bar writes
into :class:`BarLines` instead of stdout: tqdm's redraws are dropped, and the bar's state is written as
a line of its own each tenth of its total and at its end (50 units apart where the total is unknown; a
bar that a terminal would clear, as a fit's validation's, only its last line); a fit says one line each
tenth of its steps (:func:`train_line`). The bar itself is whatever class ``TQDMProgressBar`` makes its
bars from (``tqdm_progress.Tqdm``, patched or replaced by a user or a test): only where it writes changes.
``AudioProgressBar`` does this where stdout does not redraw (:func:`redraws`).
"""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

LINE_FORMAT = "{desc}{n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
PARTS = 10  # lines per bar (a fit's steps, a predict's audio seconds)
UNKNOWN_TOTAL_EVERY = 50


def redraws() -> bool:
    """Whether stdout shows a bar redrawn in place: a terminal, or a notebook (whose output renders ``\\r``)."""
    return sys.stdout.isatty() or type(sys.stdout).__module__.startswith("ipykernel")


class BarLines:
    """The file a bar writes to off a terminal (``file=``): each write is a redraw, after which the bar's
    state is written to ``out`` as a line when one is due (see the module docstring). ``quiet``: no line
    at all (a fit's bar, whose lines the progress callback writes). ``bar`` is set once the bar is made."""

    def __init__(self, out: TextIO, quiet: bool = False) -> None:
        self.out, self.quiet = out, quiet
        self.bar: Any = None
        self._printed = 0.0  # n at the last line written

    def write(self, text: str) -> int:
        bar = self.bar
        if bar is None or self.quiet:
            return len(text)
        n, total = bar.n, bar.total
        if n < self._printed:  # reset: the next dataloader
            self._printed = 0.0
        closing = bar.disable  # tqdm's close disables the bar before its last redraw
        if n and ((closing and n != self._printed) or (not closing and bar.leave and self._due(n, total))):
            self.out.write(bar.format_meter(**{**bar.format_dict, "bar_format": LINE_FORMAT}) + "\n")
            self.out.flush()
            self._printed = n
        return len(text)

    def flush(self) -> None:
        pass  # each line is flushed as it is written

    def _due(self, n: float, total: float | None) -> bool:
        if total and total != float("inf"):
            return int(PARTS * n / total) > int(PARTS * self._printed / total)
        return n - self._printed >= UNKNOWN_TOTAL_EVERY


def line_every(trainer: Any) -> int:
    """Steps between a fit's lines: a tenth of ``max_steps``, else an epoch's batches (or 50)."""
    if trainer.max_steps and trainer.max_steps > 0:
        return max(1, math.ceil(trainer.max_steps / PARTS))
    batches = trainer.num_training_batches
    return int(batches) if batches and batches != float("inf") else UNKNOWN_TOTAL_EVERY


def train_line(trainer: Any, metrics: dict[str, Any], elapsed_s: float) -> str:
    """``Epoch 3, step 8/40 (35 s): train/loss=11.90, ...``: where a fit is, for a log file; the values as the
    bar on a terminal shows them (``Tqdm.format_num``)."""
    of = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
    values = ", ".join(f"{k}={Tqdm.format_num(v)}" for k, v in metrics.items())
    return f"Epoch {trainer.current_epoch}, step {trainer.global_step}{of} ({elapsed_s:.0f} s)" + (
        f": {values}" if values else ""
    )
