"""Evaluating a model on a Task's validation data, and predicting its outputs for any data."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from redline.errors import invalid
from redline.parallel.collectives import all_reduce_sum
from redline.parallel.env import DistEnv
from redline.runtime.contract import check_loss, count_samples, metric_value, split_batch, user_code
from redline.runtime.runtime import Runtime
from redline.task import Task
from redline.train.data import eval_loader


@torch.no_grad()
def evaluate_model(
    task: Task, model: nn.Module, rt: Runtime, batch_size: int, env: DistEnv | None = None, *, where: str = "evaluation"
) -> dict[str, float | None]:
    """Return the mean validation loss and metric, weighting each batch by its size.

    Under several processes each rank evaluates its own contiguous shard and the sums are added
    over the ranks, so every sample counts exactly once. A compiled model evaluates through its own
    (eager) forward, under the run's autocast: a partial last batch would otherwise compile again.
    ``where`` starts an error's message.
    """
    env = env or DistEnv()
    assert task.val_data is not None
    total_loss, total_metric, count = 0.0, 0.0, 0
    with _eval_mode(model):
        for batch in eval_loader(task.val_data, batch_size=batch_size, rank=env.rank, world_size=env.world_size):
            inputs, targets = split_batch(rt.to_device(batch), "val_data")
            with user_code(where, inputs, targets), rt.eager(), rt.autocast():  # eager: no graph per eval shape
                outputs = model(inputs)
                loss = check_loss(task.loss_fn(outputs, targets), training=False)
            with user_code(where, outputs, targets, metric=True):
                metric = metric_value(task.metric(outputs, targets)) if task.metric is not None else 0.0
            n = count_samples(inputs)
            total_loss += loss.item() * n
            total_metric += metric * n
            count += n
    total_loss, total_metric, count = all_reduce_sum(torch.tensor([total_loss, total_metric, float(count)])).tolist()
    if count == 0:
        return {"val_loss": math.nan, "val_metric": None}
    return {"val_loss": total_loss / count, "val_metric": total_metric / count if task.metric else None}


@torch.no_grad()
def predict_outputs(model: nn.Module, rt: Runtime, data: Any, batch_size: int) -> torch.Tensor:
    """Return ``model``'s outputs for ``data`` (a Dataset of inputs or of (inputs, targets)), on CPU."""
    outputs = []
    with _eval_mode(model):
        for batch in eval_loader(data, batch_size=batch_size):
            inputs = batch[0] if isinstance(batch, list | tuple) else batch
            with rt.autocast(), rt.eager():
                outputs.append(model(rt.to_device(inputs)).float().cpu())
    if not outputs:
        raise invalid("len(data)", 0, "at least one item to predict", "check how the data is built: it is empty")
    return torch.cat(outputs)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode inside, and back in the mode it had after, even when the user's code raised."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
