"""The serving log (``omni_lightning.serving``'s logger) on stderr, in every process ``serve`` owns
(``to_stderr``: its fronts, its engines, its one process), and the line of a request or stream that ends:
its id, status, frames and seconds since it came, once decoding began (a refusal before that is one line of
its own, with the reason). Not done: per-request timings inside the decode loop (``/metrics`` has the
steps' and a stream chunk's time in the loop)."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("omni_lightning.serving")


def ended(rid: str, status: str, frames: int, started: float, what: str = "") -> None:
    """Logs ``serve: <rid>[ what] ended <status>: <frames> frames in <seconds> s`` (``started``: a
    ``time.perf_counter()`` reading taken when the request came)."""
    took = time.perf_counter() - started
    log.info("serve: %s%s ended %s: %d frames in %.2f s", rid, what, status, frames, took)


def to_stderr() -> logging.Logger:
    """The serving log on stderr, timestamped, at INFO (once per process; a caller's own handlers, where the
    logger has some, are kept)."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
