"""Requests in: dataset, collate, length-bucketing sampler, data module. Names load on first use
(PEP 562), so ``omni_lightning.data.files`` (standard library only) imports without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "collate_codes": "omni_lightning.data.collate",
    "CodesDataModule": "omni_lightning.data.datamodule",
    "CodesDataset": "omni_lightning.data.dataset",
    "LengthBucketBatchSampler": "omni_lightning.data.sampler",
}

__all__ = [
    "CodesDataModule",
    "CodesDataset",
    "LengthBucketBatchSampler",
    "collate_codes",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from omni_lightning.data.collate import collate_codes
    from omni_lightning.data.datamodule import CodesDataModule
    from omni_lightning.data.dataset import CodesDataset
    from omni_lightning.data.sampler import LengthBucketBatchSampler
