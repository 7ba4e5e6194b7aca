"""What a Trainer answers besides fit(): its model's validation loss and metric, and its outputs for any data, from
the model it trained, or from a fresh or resumed one where it has not trained yet."""

from __future__ import annotations

from typing import Any

from torch import nn

from redline.errors import ConfigError
from redline.parallel.env import DistEnv
from redline.runtime.runtime import Runtime
from redline.task import Task
from redline.train.evaluation import evaluate_model, predict_outputs


class TrainedModel:
    """The Trainer's ``evaluate()`` and ``predict()``, over the model and Runtime it holds."""

    task: Task
    env: DistEnv
    batch_size: int
    rt: Runtime | None
    model: nn.Module | None

    def _ready(self) -> tuple[Runtime, nn.Module]:  # the Trainer's: its model, set up where it has not trained
        raise NotImplementedError

    def evaluate(self) -> dict[str, float | None]:
        """Return validation loss and metric of the trained model (or of a fresh/resumed one)."""
        if self.task.val_data is None:
            raise ConfigError(f"task {self.task.name!r} has no val_data to evaluate on")
        rt, model = self._ready()
        return evaluate_model(self.task, model, rt, max(1, self.batch_size // self.env.world_size), self.env)

    def predict(self, data: Any, batch_size: int | None = None) -> Any:
        """Return the model's outputs for ``data`` (a Dataset of inputs or of (inputs, targets)), on CPU: a
        tensor, or the tuple, list or dict of tensors the model returns. An item that is a tuple is read as
        (inputs, targets): a model of several inputs takes items ((a, b),) or ((a, b), targets). A Task's
        collate_fn batches items of the kind the Task's data holds, as in training; bare inputs (a tensor or array
        each, where the Task's items are pairs, tuples or dicts) are stacked (``predict_outputs``)."""
        rt, model = self._ready()
        size = self.batch_size if batch_size is None else batch_size
        return predict_outputs(model, rt, data, size, task=self.task)
