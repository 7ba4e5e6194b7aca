"""The small task of the resume tests, as `redline train --task FILE:small` builds it: a 16 -> 32 -> 2 MLP on 100
training samples at batch 16 (7 steps an epoch), validated on 40, the two drawn from one set by ``split_seed``."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline


def small(split_seed: int = 0, val_seed: int = 0) -> redline.Task:
    """``split_seed`` moves the split of 140 samples into train and val (each as long); ``val_seed`` draws 40 other
    validation samples, the training set as it was."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(140, 16, generator=gen)
    y = (x[:, :4].sum(1) > 0).long()
    order = torch.randperm(140, generator=torch.Generator().manual_seed(split_seed))
    train, val = order[:100], order[100:]
    if val_seed:
        val = torch.randperm(140, generator=torch.Generator().manual_seed(val_seed))[:40]
    return redline.Task(
        model=lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)),
        loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x[train], y[train]),
        val_data=TensorDataset(x[val], y[val]), optimizer=lambda params: torch.optim.AdamW(params, lr=0.05),
        batch_size=16, epochs=3, name="small",
    )  # fmt: skip
