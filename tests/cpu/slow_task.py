"""A Task whose training steps from the third on take ``step_s`` seconds, and whose evaluations after them ``eval_s``:
time for signals to arrive while a step runs, and while the run stops (its final evaluation).

redline train --task tests/cpu/slow_task.py:task --task-arg eval_s=60 --nproc 2 --out DIR
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline


class Slow(nn.Module):
    def __init__(self, step_s: float, eval_s: float) -> None:
        super().__init__()
        self.lin, self.step_s, self.eval_s, self.steps = nn.Linear(4, 2), step_s, eval_s, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_meta:  # not the FLOP count's pass
            if self.training and torch.is_grad_enabled():
                self.steps += 1
                if self.steps > 2:
                    time.sleep(self.step_s)
            elif self.steps > 2:
                time.sleep(self.eval_s)
        return self.lin(x)


def task(step_s: float = 1.0, eval_s: float = 60.0) -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=gen), torch.randint(0, 2, (64,), generator=gen))
    return redline.Task(
        model=lambda: Slow(step_s, eval_s),
        loss_fn=nn.functional.cross_entropy,
        train_data=data,
        val_data=data,
        batch_size=8,
        epochs=100,
        name="slow",
    )
