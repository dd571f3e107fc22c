"""What the command line prints besides its own output: known third-party noise silenced, warnings
as one line. Shared by ``cli`` and ``demo``; standard library only (it runs before torch loads)."""

from __future__ import annotations

import logging
import warnings


def quiet_known_noise() -> None:
    """Silences, precisely, what a user of this CLI can do nothing about.

    - torch deprecated ``isinstance(x, LeafSpec)``, which Lightning's own ``_pytree`` still calls;
    - Lightning's advertisements for the litlogger and litmodels packages, printed by every trainer.
    Each filter matches one message; everything else (our own warnings included) still shows.
    """
    leafspec = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
    warnings.filterwarnings("ignore", message=leafspec, category=FutureWarning)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_drop_litlogger_tip)


def _drop_litlogger_tip(record: logging.LogRecord) -> bool:
    message = str(record.msg)
    return not message.startswith("💡 Tip") or ("litlogger" not in message and "litmodels" not in message)


def compact_warnings() -> None:
    """Warnings as one ``warning: ...`` line, not Python's file:line plus source line."""
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"warning: {message}\n"
