"""Tasks that each rank of a launched job builds its own way (by RANK), for test_rank_disagreement.py."""

from __future__ import annotations

import dataclasses
import os
import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline

RANK = int(os.environ.get("RANK", "0"))


def tiny(hidden: int = 8, model: type[nn.Module] | None = None) -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randint(0, 2, (32,), generator=gen))
    return redline.Task(
        model=model or (lambda: nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))),
        loss_fn=nn.functional.cross_entropy, train_data=data, val_data=data, batch_size=8, name="tiny",
    )  # fmt: skip


def width() -> redline.Task:
    """A model 8 wide on rank 0 and 4 wide on rank 1."""
    return tiny(hidden=8 if RANK == 0 else 4)


class FailsEvaluatingOnRank1(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and RANK == 1 and not x.is_meta:
            raise RuntimeError("rank 1 fails evaluating")
        return super().forward(x)


def eval_fails() -> redline.Task:
    """A model whose evaluation raises on rank 1: rank 0 is left in the evaluation's all-reduce."""
    return tiny(model=FailsEvaluatingOnRank1)


def eval_signal() -> redline.Task:
    """Rank 1 alone is sent SIGINT in the middle of the evaluation at step 2 (its metric's third call: the first is
    val_data's first batch, checked after step 1, and each evaluation is 4 batches of 4 on each rank)."""
    calls = [0]

    def metric(outputs: torch.Tensor, targets: torch.Tensor) -> float:
        calls[0] += 1
        if RANK == 1 and calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return float((outputs.argmax(-1) == targets).float().mean())

    return dataclasses.replace(tiny(), metric=metric)
