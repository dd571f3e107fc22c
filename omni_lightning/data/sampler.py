"""``LengthBucketBatchSampler``: batches of similar length, so little of each batch is padding; under
DDP, the split of the requests across ranks, by length."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from omni_lightning.errors import UsageError


class LengthBucketBatchSampler(BatchSampler):
    """Sorts the indices ``sampler`` yields by length and cuts them into batches.

    A batch closes at ``batch_size`` requests or when its padded size (requests x longest) would
    pass ``max_frames``. Deterministic: ``shuffle`` permutes the batches with ``seed + epoch``
    (``set_epoch``). ``lengths`` defaults to the sampler's dataset's ``lengths``.

    Several ranks: ``num_replicas`` and ``rank`` (or a ``DistributedSampler`` given as ``sampler``,
    whose own order and padding are not used) split the whole dataset; every rank computes the same
    split, so nothing is exchanged.

    - ``even_batches=False`` (predict, validate, test): each request goes to one rank. Requests are
      dealt longest first in a serpentine (ranks 0..N-1, then N-1..0, ...), so ranks get as many
      requests as each other (one more at most) and similar frame totals. A rank may get none.
    - ``even_batches=True`` (fit): every rank yields the same number of batches, as DDP's lockstep
      needs: one process's batches of ``batch_size x world`` requests, each dealt to the ranks by
      stride; a rank the batch leaves empty repeats one of its items (the only repeats).
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
        even_batches: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
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
        self.sampler = _EpochRelay(sampler, self)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.lengths = list(lengths)
        self.max_frames = max_frames
        self.shuffle = shuffle
        self.seed = seed
        self.even_batches = even_batches
        self.epoch = 0
        injected = isinstance(sampler, DistributedSampler) and num_replicas is None  # (the sampler given)
        self.num_replicas = sampler.num_replicas if injected else (num_replicas or 1)
        self.rank = sampler.rank if injected else (rank or 0)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank must be in [0, {self.num_replicas}), got {self.rank}")

    def set_epoch(self, epoch: int) -> None:
        """The shuffle's epoch; passed on to the inner sampler and to the dataset it reads, if they take
        one (``CodesDataset`` keys its training crops on it)."""
        self.epoch = epoch
        inner = self.sampler.inner
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        dataset = getattr(inner, "dataset", None) or getattr(inner, "data_source", None)
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)

    def _indices(self) -> list[int]:
        """Every index to split: a distributed sampler's whole dataset, else what ``sampler`` yields."""
        inner = self.sampler.inner
        if isinstance(inner, DistributedSampler):  # its iteration is one rank's share: not ours
            return list(range(len(inner.dataset)))
        return list(inner)

    def _cut(self, indices: list[int], rows: int, fits: Callable[[int, int], bool]) -> list[list[int]]:
        """``indices`` sorted by length, cut at ``rows`` requests or where ``fits(requests, longest)`` fails."""
        batches: list[list[int]] = []
        batch: list[int] = []
        for i in sorted(indices, key=lambda i: (self.lengths[i], i)):
            longest = max(self.lengths[i], 1)  # lengths are sorted: i is the longest so far
            if batch and (len(batch) == rows or not fits(len(batch) + 1, longest)):
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch and not (self.drop_last and len(batch) < rows):
            batches.append(batch)
        return batches

    def _fits(self, world: int) -> Callable[[int, int], bool]:
        if self.max_frames is None:
            return lambda requests, longest: True
        return lambda requests, longest: math.ceil(requests / world) * longest <= self.max_frames

    def share(self) -> list[int]:
        """``even_batches=False``: the indices of this rank (all of them on one rank), in dealing order."""
        world = self.num_replicas
        order = sorted(self._indices(), key=lambda i: (-self.lengths[i], i))
        if world == 1:
            return order
        rank_of = [p % world if (p // world) % 2 == 0 else world - 1 - p % world for p in range(len(order))]
        return [i for i, r in zip(order, rank_of) if r == self.rank]

    def _batches(self) -> list[list[int]]:
        world = self.num_replicas
        if self.even_batches:
            batches = self._cut(self._indices(), self.batch_size * world, self._fits(world))
        else:
            batches = self._cut(self.share(), self.batch_size, self._fits(1))
        if self.shuffle:
            order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            batches = [batches[j] for j in order.tolist()]
        if self.even_batches and world > 1:
            batches = [batch[self.rank :: world] or [batch[self.rank % len(batch)]] for batch in batches]
        return batches

    def start_after(self, batches: int) -> None:
        """The next iteration leaves out its first ``batches`` batches, unread (a fit resumed within an epoch)."""
        self._skip = batches

    def __iter__(self) -> Iterator[list[int]]:
        skip, self._skip = getattr(self, "_skip", 0), 0
        yield from self._batches()[skip:]

    def __len__(self) -> int:
        return len(self._batches())


class _EpochRelay:
    """The sampler a :class:`LengthBucketBatchSampler` reads (``inner``), whose ``set_epoch`` reaches the
    batch sampler: Lightning calls ``set_epoch`` on a batch sampler's ``sampler``, never on the batch
    sampler itself. Iteration, length and other attributes are ``inner``'s."""

    def __init__(self, inner: Sampler[int] | Iterable[int], owner: LengthBucketBatchSampler) -> None:
        self.inner, self.owner = inner, owner

    def set_epoch(self, epoch: int) -> None:
        self.owner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "owner"):  # not set yet (unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.inner, name)
