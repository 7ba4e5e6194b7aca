"""Data order a resumed run can continue exactly: shuffled by (seed, epoch), started mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler


class EpochSampler(Sampler[int]):
    """Yield a dataset's indices in an order fixed by ``seed`` and the epoch, from any position.

    The permutation of epoch ``e`` comes from a generator seeded with ``seed + e``, so it does not
    depend on anything else the run does with random numbers; ``set_epoch(e, skip=k)`` starts the
    epoch after its first ``k`` indices, which is how a resumed run continues mid-epoch.
    """

    def __init__(self, size: int, *, shuffle: bool, seed: int) -> None:
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch = epoch
        self.skip = min(skip, self.size)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.size)
        return iter(order[self.skip :].tolist())

    def __len__(self) -> int:
        return self.size - self.skip


def train_loader(dataset: Dataset[Any], *, batch_size: int, seed: int) -> tuple[DataLoader[Any], EpochSampler]:
    """Return a shuffling DataLoader over ``dataset`` and the sampler that fixes its order."""
    if not hasattr(dataset, "__len__"):
        raise TypeError("the Trainer needs a map-style dataset with __len__ to resume exactly")
    sampler = EpochSampler(len(dataset), shuffle=True, seed=seed)
    batches = BatchSampler(sampler, batch_size=batch_size, drop_last=False)
    # A DataLoader draws its workers' base seed from this generator, not from torch's global RNG,
    # so starting an epoch (or a resumed one) leaves the model's random stream (dropout) untouched.
    return DataLoader(dataset, batch_sampler=batches, generator=torch.Generator().manual_seed(seed)), sampler


def eval_loader(dataset: Dataset[Any], *, batch_size: int) -> DataLoader[Any]:
    """Return an in-order DataLoader that, like ``train_loader``, leaves the global RNG alone."""
    return DataLoader(dataset, batch_size=batch_size, generator=torch.Generator().manual_seed(0))


def batches_per_epoch(size: int, batch_size: int) -> int:
    """Return the number of batches in a full epoch (the last one may be short)."""
    return -(-size // batch_size)
