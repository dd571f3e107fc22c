"""The decode engine: kernels, shapes, CUDA graphs and memory for every decode of a ``Code2Wav``
(batch, long requests, streaming), exact at any length. Names load on first use (PEP 562)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_lightning.imports.lazy import lazy_exports

_EXPORTS = {
    "DecodeEngine": "omni_lightning.engine.engine",
    "Planner": "omni_lightning.engine.plan",
    "StreamingDecoder": "omni_lightning.engine.streaming",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(globals(), _EXPORTS)


if TYPE_CHECKING:
    from omni_lightning.engine.engine import DecodeEngine
    from omni_lightning.engine.plan import Planner
    from omni_lightning.engine.streaming import StreamingDecoder
