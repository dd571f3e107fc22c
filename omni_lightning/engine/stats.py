"""``EngineStats``: what a ``DecodeEngine`` did, as numbers (``stats``) and one log line (``report``).

A mixin of ``DecodeEngine`` (it reads the engine's ``planner``, ``work``, ``graphs`` and ``device``).
"""

from __future__ import annotations

from typing import Any

import torch


class EngineStats:
    planner: Any
    work: dict[str, Any]
    graphs: Any
    device: torch.device

    def stats(self) -> dict[str, float]:
        """The frame budget; forwards, real and computed (padded) frames since the engine was built; the
        shapes first run since, and the host seconds of their first forwards (cuDNN plans, captures);
        graphs captured, their capture seconds, replays, eager forwards and failed captures; peak
        reserved GiB on CUDA."""
        out: dict[str, float] = {"frames_per_forward": self.planner.frames, **self.work}
        if self.graphs is not None:
            s = self.graphs.stats
            out.update(
                captures=s.captures, capture_s=s.capture_s, replays=s.replays, eager=s.eager, failures=s.failures
            )
        if self.device.type == "cuda":
            out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        return out

    def report(self) -> str:
        """:meth:`stats` in one line."""
        s = self.stats()
        line = f"decode engine: {s['frames_per_forward']} frames per forward"
        if s["computed"]:
            line += (
                f", {s['forwards']} forwards ({1 - s['frames'] / s['computed']:.0%} padding), "
                f"{s['new_shapes']} shapes (first runs {s['new_shape_s']:.2f} s)"
            )
        if "captures" in s:
            line += (
                f", {s['captures']} CUDA graph(s) captured in {s['capture_s']:.2f} s, {s['replays']} replays, "
                f"{s['eager']} eager forwards"
            )
        if "peak_reserved_gib" in s:
            line += f", peak reserved {s['peak_reserved_gib']:.2f} GiB"
        return line
