"""omni_lightning: the Code2Wav stage of omni speech models in PyTorch Lightning."""

from omni_lightning.callbacks import AsyncD2HCallback, WaveformWriter
from omni_lightning.data import CodesDataModule, CodesDataset, LengthBucketBatchSampler, collate_codes
from omni_lightning.models import (
    Code2Wav,
    Code2WavConfig,
    StreamingDecoder,
    randomize_weights,
    resolve_config,
    validate_codes,
)
from omni_lightning.module import Code2WavModule
from omni_lightning.runner import MultimodalOutputs, OmniModelRunnerOutput, OmniPredictionLoop, build_pooler_output
from omni_lightning.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "AsyncD2HCallback",
    "Code2Wav",
    "Code2WavConfig",
    "Code2WavModule",
    "CodesDataModule",
    "CodesDataset",
    "LengthBucketBatchSampler",
    "MultimodalOutputs",
    "OmniModelRunnerOutput",
    "OmniPredictionLoop",
    "StreamingDecoder",
    "Trainer",
    "WaveformWriter",
    "build_pooler_output",
    "collate_codes",
    "randomize_weights",
    "resolve_config",
    "validate_codes",
]
