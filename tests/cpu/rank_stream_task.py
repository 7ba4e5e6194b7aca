"""A Task whose streams yield each rank its own share (``splits_across_ranks = True``), as the README tells
setup_loader users to write one; its model records the first feature of every batch it is given.

redline train --task tests/cpu/rank_stream_task.py:task --task-arg log=DIR --nproc 2 --max-steps 4
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset

import redline


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class RankShare(IterableDataset):
    """Items ``first .. first + n - 1``; each rank yields every world-th of them from its rank."""

    splits_across_ranks = True

    def __init__(self, first: int, n: int, world: int | None = None, rank: int | None = None) -> None:
        self.first, self.n, self.world, self.rank = first, n, world, rank  # world/rank: given, or the group's

    def _where(self) -> tuple[int, int]:
        rank, world = rank_and_world()
        return (rank if self.rank is None else self.rank), (world if self.world is None else self.world)

    def __len__(self) -> int:  # this rank's share
        rank, world = self._where()
        return len(range(rank, self.n, world))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rank, world = self._where()
        for i in range(rank, self.n, world):
            yield torch.tensor([float(self.first + i), 0.5]), torch.tensor(i % 2)


class Recording(nn.Module):
    """A linear layer that appends the first feature of each batch to LOG/train-RANK.txt or LOG/eval-RANK.txt."""

    def __init__(self, log: str) -> None:
        super().__init__()
        self.log, self.lin = Path(log), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_meta and self.log.name:
            kind = "train" if self.training and torch.is_grad_enabled() else "eval"
            with open(self.log / f"{kind}-{os.environ.get('RANK', '0')}.txt", "a") as f:
                f.write(" ".join(str(int(v)) for v in x[:, 0].tolist()) + "\n")
        return self.lin(x)


def task(log: str = "") -> redline.Task:
    return redline.Task(
        model=lambda: Recording(log),
        loss_fn=nn.CrossEntropyLoss(),
        train_data=RankShare(0, 40),
        val_data=RankShare(1000, 20),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),
        batch_size=10,
        name="rank_stream",
    )
