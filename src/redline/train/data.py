"""The Trainer's data loaders: an exactly resumable training order, and an in-order evaluation."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from redline.runtime.sampling import EpochSampler, GlobalBatchSampler


def train_loader(
    dataset: Dataset[Any], *, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
) -> tuple[DataLoader[Any], EpochSampler]:
    """Return a shuffling DataLoader over ``dataset`` (this rank's share of each global batch) and its sampler."""
    if not hasattr(dataset, "__len__"):
        raise TypeError("the Trainer needs a map-style dataset with __len__ to resume exactly")
    sampler = EpochSampler(len(dataset), shuffle=True, seed=seed)
    batches = GlobalBatchSampler(sampler, global_batch=batch_size, rank=rank, world_size=world_size)
    # A DataLoader draws its workers' base seed from this generator, not from torch's global RNG,
    # so starting an epoch (or a resumed one) leaves the model's random stream (dropout) untouched.
    return DataLoader(dataset, batch_sampler=batches, generator=torch.Generator().manual_seed(seed)), sampler


def eval_loader(dataset: Dataset[Any], *, batch_size: int, rank: int = 0, world_size: int = 1) -> DataLoader[Any]:
    """Return an in-order DataLoader over this rank's contiguous shard: every sample is seen exactly once."""
    if world_size > 1:
        size = len(dataset)  # type: ignore[arg-type]
        start, stop = size * rank // world_size, size * (rank + 1) // world_size
        dataset = Subset(dataset, range(start, stop))
    return DataLoader(dataset, batch_size=batch_size, generator=torch.Generator().manual_seed(0))
