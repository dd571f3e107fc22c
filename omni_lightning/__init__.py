"""omni_lightning: the Code2Wav stage of omni speech models in PyTorch Lightning.

The public names below are imported on first use (PEP 562), so ``omni-lightning``'s command line can
check its arguments before torch and Lightning are loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_lightning.imports.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncD2HCallback": "omni_lightning.callbacks",
    "WaveformWriter": "omni_lightning.callbacks",
    "CodesDataModule": "omni_lightning.data",
    "CodesDataset": "omni_lightning.data",
    "LengthBucketBatchSampler": "omni_lightning.data",
    "collate_codes": "omni_lightning.data",
    "Code2Wav": "omni_lightning.models",
    "Code2WavConfig": "omni_lightning.models",
    "randomize_weights": "omni_lightning.models",
    "resolve_config": "omni_lightning.models",
    "validate_codes": "omni_lightning.models",
    "DecodeState": "omni_lightning.models",
    "DecodeEngine": "omni_lightning.engine",
    "StreamingDecoder": "omni_lightning.engine",
    "InterruptedFitCheckpoint": "omni_lightning.training.interrupted",
    "Code2WavModule": "omni_lightning.module",
    "MultimodalOutputs": "omni_lightning.runner",
    "OmniModelRunnerOutput": "omni_lightning.runner",
    "OmniPredictionLoop": "omni_lightning.runner",
    "build_pooler_output": "omni_lightning.runner",
    "Trainer": "omni_lightning.trainer",
    "UsageError": "omni_lightning.errors",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(globals(), _EXPORTS)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from omni_lightning.callbacks import AsyncD2HCallback, WaveformWriter
    from omni_lightning.data import CodesDataModule, CodesDataset, LengthBucketBatchSampler, collate_codes
    from omni_lightning.engine import DecodeEngine, StreamingDecoder
    from omni_lightning.errors import UsageError
    from omni_lightning.models import (
        Code2Wav,
        Code2WavConfig,
        DecodeState,
        randomize_weights,
        resolve_config,
        validate_codes,
    )
    from omni_lightning.module import Code2WavModule
    from omni_lightning.runner import MultimodalOutputs, OmniModelRunnerOutput, OmniPredictionLoop, build_pooler_output
    from omni_lightning.trainer import Trainer
    from omni_lightning.training.interrupted import InterruptedFitCheckpoint
