"""Code2Wav: config and presets, the model, code validation, checkpoints. Names load on first use
(PEP 562), so ``omni_lightning.models.config`` (presets) imports without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_lightning.imports.lazy import lazy_exports

_EXPORTS = {
    "Code2Wav": "omni_lightning.models.code2wav",
    "validate_codes": "omni_lightning.models.codes",
    "Code2WavConfig": "omni_lightning.models.config",
    "resolve_config": "omni_lightning.models.config",
    "randomize_weights": "omni_lightning.models.random_weights",
    "DecodeState": "omni_lightning.models.state",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(globals(), _EXPORTS)


if TYPE_CHECKING:
    from omni_lightning.models.code2wav import Code2Wav
    from omni_lightning.models.codes import validate_codes
    from omni_lightning.models.config import Code2WavConfig, resolve_config
    from omni_lightning.models.random_weights import randomize_weights
    from omni_lightning.models.state import DecodeState
