"""Requests in: dataset, collate, length-bucketing sampler, data module. Names load on first use
(PEP 562), so ``omni_lightning.data.files`` (standard library only) imports without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_lightning.imports.lazy import lazy_exports

_EXPORTS = {
    "collate_codes": "omni_lightning.data.collate",
    "CodesDataModule": "omni_lightning.data.datamodule",
    "CodesDataset": "omni_lightning.data.dataset",
    "LengthBucketBatchSampler": "omni_lightning.data.sampler",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(globals(), _EXPORTS)


if TYPE_CHECKING:
    from omni_lightning.data.collate import collate_codes
    from omni_lightning.data.datamodule import CodesDataModule
    from omni_lightning.data.dataset import CodesDataset
    from omni_lightning.data.sampler import LengthBucketBatchSampler
