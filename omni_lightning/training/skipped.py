"""``SkippedRequests``: fit and evaluation say which bad requests they left out.

With ``on_bad_input="skip"`` the data module keeps a bad request (missing or unreadable audio, NaN
samples, a manifest line without audio) out of its batch and lists it under the batch's ``errors``.
Predict writes those to its manifest; fit, validate and test have no manifest, so this warns once
per run and request. Not done: a summary at the end of the run.
"""

from __future__ import annotations

from typing import Any


class SkippedRequests:
    """The ``(stage, id)`` pairs already warned about in this run; cleared when a run is set up."""

    def __init__(self) -> None:
        self.reported: set[tuple[str, str]] = set()

    def clear(self) -> None:
        self.reported.clear()

    def report(self, batch: dict[str, Any], stage: str) -> bool:
        """Warns about each request of ``batch["errors"]`` not yet reported; returns whether the batch
        still holds a request (a batch of only bad requests has none: no step)."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        for req_id, reason in (batch.get("errors") or {}).items():
            if (stage, req_id) not in self.reported:
                self.reported.add((stage, req_id))
                rank_zero_warn(f"{stage}: request {req_id!r} skipped: {reason}")
        return bool(batch.get("req_ids", True))
