"""The log line of a request or stream that ends (``omni_lightning.serving``'s logger): its id, status,
frames and seconds since it came, once decoding began (a refusal before that is one line of its own,
with the reason). Not done: per-request timings inside the decode loop (``/metrics`` has the steps')."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("omni_lightning.serving")


def ended(rid: str, status: str, frames: int, started: float, what: str = "") -> None:
    """Logs ``serve: <rid>[ what] ended <status>: <frames> frames in <seconds> s`` (``started``: a
    ``time.perf_counter()`` reading taken when the request came)."""
    took = time.perf_counter() - started
    log.info("serve: %s%s ended %s: %d frames in %.2f s", rid, what, status, frames, took)
