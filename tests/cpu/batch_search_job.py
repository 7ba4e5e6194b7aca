"""Tasks whose model runs out of memory above a batch size, and a job the distributed test launches.

    python batch_search_job.py LIMIT_RANK0 LIMIT_RANK1 [--bug-on-rank-1] [--oom-building-on-rank-1]
    (under `redline launch --nproc 2`)

Each rank's model raises torch.OutOfMemoryError above its own limit, as a device that full would;
the job prints the search each rank returned, as one JSON line. With --bug-on-rank-1, rank 1's
loss raises a ValueError above a batch of 4 (a bug, not an out-of-memory). With --oom-building-on-rank-1,
rank 1 runs out of memory building its model, before DDP's constructor runs its collectives.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline


class OutOfMemoryAbove(torch.autograd.Function):
    """The identity, whose backward (or forward) runs out of memory above ``limit`` samples."""

    @staticmethod
    def forward(ctx, x, limit, where):
        ctx.limit = limit
        if where == "forward" and x.shape[0] > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows (forward)")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[0] > ctx.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {grad.shape[0]} rows (backward)")
        return grad, None, None


class Limited(nn.Module):
    """A small MLP on a device that holds at most ``limit`` samples' activations."""

    built = 0  # models built so far: each probe builds its own

    def __init__(self, limit: int, where: str) -> None:
        super().__init__()
        Limited.built += 1
        self.limit, self.where = limit, where
        self.first, self.rest = nn.Linear(4, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = OutOfMemoryAbove.apply(self.first(x), self.limit, self.where)  # on activations: it has a backward
        return self.rest(hidden)


def limited_task(limit: int, where: str = "forward", samples: int = 100) -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, 4, generator=gen), torch.randint(0, 2, (samples,), generator=gen))
    return redline.Task(
        model=lambda: Limited(limit, where), loss_fn=nn.functional.cross_entropy, train_data=data, name="limited"
    )


if __name__ == "__main__":
    rank = int(os.environ.get("RANK", "0"))
    task = limited_task(int(sys.argv[1 + rank]))
    if "--bug-on-rank-1" in sys.argv and rank == 1:

        def buggy_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if out.shape[0] > 4:
                raise ValueError("a bug in rank 1's loss")
            return nn.functional.cross_entropy(out, y)

        task = redline.Task(model=task.model, loss_fn=buggy_loss, train_data=task.train_data)
    if "--oom-building-on-rank-1" in sys.argv and rank == 1:

        def too_large() -> nn.Module:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate the weights")

        task = redline.Task(model=too_large, loss_fn=task.loss_fn, train_data=task.train_data)
    search = redline.find_batch_size(task, options=redline.RuntimeOptions(devices="cpu"), max_batch_size=64)
    # one write of the whole line: print() writes the text and its newline apart, and two ranks sharing
    # the launcher's stdout could put one rank's line between the other's text and newline
    sys.stdout.write(json.dumps({"rank": rank, **search.to_dict()}) + "\n")
    sys.stdout.flush()
