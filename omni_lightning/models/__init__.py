"""Code2Wav: config and presets, the model, code validation, checkpoints. Names load on first use
(PEP 562), so ``omni_lightning.models.config`` (presets, no torch) imports in milliseconds."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Code2Wav": "omni_lightning.models.code2wav",
    "validate_codes": "omni_lightning.models.codes",
    "Code2WavConfig": "omni_lightning.models.config",
    "resolve_config": "omni_lightning.models.config",
    "randomize_weights": "omni_lightning.models.random_weights",
    "StreamingDecoder": "omni_lightning.models.streaming",
}

__all__ = [
    "Code2Wav",
    "Code2WavConfig",
    "randomize_weights",
    "resolve_config",
    "StreamingDecoder",
    "validate_codes",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from omni_lightning.models.code2wav import Code2Wav
    from omni_lightning.models.codes import validate_codes
    from omni_lightning.models.config import Code2WavConfig, resolve_config
    from omni_lightning.models.random_weights import randomize_weights
    from omni_lightning.models.streaming import StreamingDecoder
