"""Evaluating a model on a Task's validation data."""

from __future__ import annotations

import math

import torch
from torch import nn

from redline.parallel.collectives import all_reduce_sum
from redline.parallel.env import DistEnv
from redline.runtime.runtime import Runtime
from redline.task import Task
from redline.train.data import eval_loader


@torch.no_grad()
def evaluate_model(
    task: Task, model: nn.Module, rt: Runtime, batch_size: int, env: DistEnv | None = None
) -> dict[str, float | None]:
    """Return the mean validation loss and metric, weighting each batch by its size.

    Under several processes each rank evaluates its own contiguous shard and the sums are added
    over the ranks, so every sample counts exactly once.
    """
    env = env or DistEnv()
    assert task.val_data is not None
    was_training = model.training
    model.eval()
    total_loss, total_metric, count = 0.0, 0.0, 0
    for batch in eval_loader(task.val_data, batch_size=batch_size, rank=env.rank, world_size=env.world_size):
        inputs, targets = rt.to_device(batch)
        with rt.autocast():
            outputs = model(inputs)
            loss = task.loss_fn(outputs, targets)
        n = len(targets)
        total_loss += loss.item() * n
        if task.metric is not None:
            total_metric += float(task.metric(outputs, targets)) * n
        count += n
    model.train(was_training)
    total_loss, total_metric, count = all_reduce_sum(torch.tensor([total_loss, total_metric, float(count)])).tolist()
    if count == 0:
        return {"val_loss": math.nan, "val_metric": None}
    return {"val_loss": total_loss / count, "val_metric": total_metric / count if task.metric else None}
