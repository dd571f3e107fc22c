"""``LengthBucketBatchSampler``: batches of similar length, so little of each batch is padding."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch.utils.data import BatchSampler, Sampler

from omni_lightning.errors import UsageError


class LengthBucketBatchSampler(BatchSampler):
    """Sorts the indices ``sampler`` yields by length and cuts them into batches.

    A batch closes at ``batch_size`` requests or when its padded size (requests x longest) would
    pass ``max_frames``. Deterministic: the same indices give the same batches; ``shuffle`` permutes
    the order of batches with ``seed + epoch`` (call ``set_epoch``). Under DDP Lightning hands each
    rank a disjoint ``sampler`` (for predict, one that never repeats an index), so every request
    goes to exactly one rank. ``lengths`` defaults to ``sampler``'s dataset's ``lengths``.
    """

    def __init__(
        self,
        sampler: Sampler[int] | Iterable[int],
        batch_size: int,
        drop_last: bool = False,
        lengths: Sequence[int] | None = None,
        max_frames: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        if batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, got {batch_size}")
        if max_frames is not None and max_frames < 1:
            raise UsageError(f"max_frames must be >= 1, got {max_frames}")
        if lengths is None:
            dataset = getattr(sampler, "dataset", None) or getattr(sampler, "data_source", None)
            lengths = getattr(dataset, "lengths", None)
            if lengths is None:
                raise ValueError("give lengths, or a sampler over a dataset with a `lengths` attribute")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.lengths = list(lengths)
        self.max_frames = max_frames
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _batches(self) -> list[list[int]]:
        indices = sorted(self.sampler, key=lambda i: (self.lengths[i], i))
        batches: list[list[int]] = []
        batch: list[int] = []
        for i in indices:
            longest = max(self.lengths[i], 1)  # lengths are sorted: i is the longest so far
            if batch and (
                len(batch) == self.batch_size
                or (self.max_frames is not None and (len(batch) + 1) * longest > self.max_frames)
            ):
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch and not (self.drop_last and len(batch) < self.batch_size):
            batches.append(batch)
        if self.shuffle:
            order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            batches = [batches[j] for j in order.tolist()]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._batches()

    def __len__(self) -> int:
        return len(self._batches())
