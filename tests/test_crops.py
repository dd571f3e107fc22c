"""Training crops: random per loader worker and per epoch."""

import torch
from helpers import TINY

from omni_lightning import CodesDataset


def test_training_crops_differ_between_loader_workers_and_epochs():
    # loader workers are the default for files on machines with cores to spare (num_workers=None)
    from torch.utils.data import DataLoader

    frames = torch.arange(60).repeat(16, 1)  # code == frame index: a crop's first code is its start
    ds = CodesDataset({f"r{i}": frames for i in range(8)}, TINY, crop_frames=5)
    loader = DataLoader(ds, batch_size=1, num_workers=2, collate_fn=lambda items: items[0])
    epochs = [[int(item["codes"][0, 0]) for item in loader] for _ in range(2)]
    worker0, worker1 = epochs[0][0::2], epochs[0][1::2]
    assert worker0 != worker1 and epochs[0] != epochs[1]
