from omni_lightning.data.collate import collate_codes
from omni_lightning.data.datamodule import CodesDataModule
from omni_lightning.data.dataset import CodesDataset
from omni_lightning.data.sampler import LengthBucketBatchSampler

__all__ = ["CodesDataModule", "CodesDataset", "LengthBucketBatchSampler", "collate_codes"]
