"""The training loop behind `redline train`: a Task, trained with the Runtime, read top to bottom."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from redline.errors import invalid
from redline.plan import Plan
from redline.runtime.runtime import Runtime
from redline.task import Task
from redline.train.output import prepare_out_dir, save_weights, write_json

LOSS_WINDOW = 20  # final_loss averages the last steps' losses: one batch's loss is noisy


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How long to train and where to write; the Runtime's options live in ``runtime``."""

    epochs: int | None = None  # None: the task's own default
    max_steps: int | None = None
    batch_size: int | None = None  # None: the task's own
    out_dir: str | None = None
    log_every: int = 50
    runtime: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("epochs", "max_steps", "batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise invalid(name, value, "a positive integer or None")
        if not isinstance(self.log_every, int) or self.log_every < 1:
            raise invalid("log_every", self.log_every, "a positive integer")


@dataclass(frozen=True, kw_only=True)
class TrainSummary:
    """What a training run produced: the Plan it ran with and the numbers that describe it."""

    task: str
    device: str
    plan: Plan
    steps: int
    epochs: float
    samples: int
    final_loss: float
    val_loss: float | None
    val_metric: float | None
    samples_per_s: float
    train_seconds: float
    compile_seconds: float | None
    sample: str | None

    def to_dict(self) -> dict[str, Any]:
        """Return the summary as JSON-ready data."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["plan"] = self.plan.to_dict()
        return data


def train(task: Task, config: TrainConfig, log: Callable[[str], None] | None = None) -> TrainSummary:
    """Train ``task`` with a Runtime built from ``config.runtime``; return the summary."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    out_dir = prepare_out_dir(config.out_dir) if config.out_dir else None
    batch_size = config.batch_size or task.batch_size
    loader = DataLoader(task.train_data, batch_size=batch_size, shuffle=True, generator=_generator(config))
    epochs = config.epochs or task.epochs
    grad_accum = int(config.runtime.get("grad_accum", 1))
    steps_per_epoch = max(1, len(loader) // grad_accum)
    total_steps = min(epochs * steps_per_epoch, config.max_steps or math.inf)
    rt = Runtime(**config.runtime, planned_steps=int(total_steps))
    model, optimizer = rt.setup(task.build_model(), task.optimizer)
    scheduler = task.scheduler(optimizer) if task.scheduler else None
    batches = rt.setup_loader(loader)

    # The loop: losses stay on the device and are read every log_every steps, never per step.
    model.train()
    losses: list[torch.Tensor] = []
    step, samples, epoch_float = 0, 0, 0.0
    start = timed_from = time.perf_counter()
    timed_samples = 0
    for epoch in range(epochs):
        for i, (inputs, targets) in enumerate(batches):
            with rt.autocast():
                loss = task.loss_fn(model(inputs), targets)
            rt.backward(loss)
            samples += len(targets)
            if not rt.step(optimizer):
                continue
            if scheduler is not None:
                scheduler.step()
            step += 1
            losses.append(loss.detach())
            if step == 1:  # the first step pays for warm-up and compiling; time from after it
                _sync(rt.device)
                timed_from, timed_samples = time.perf_counter(), samples
            if step % config.log_every == 0 or step == total_steps:
                log(f"step {step}/{int(total_steps)}  epoch {epoch + 1}  loss {loss.item():.4f}")
            epoch_float = epoch + (i + 1) / len(batches)
            if step >= total_steps:
                break
        if step >= total_steps:
            break
    _sync(rt.device)
    end = time.perf_counter()

    val_loss, val_metric = evaluate(task, model, rt, batch_size) if task.val_data is not None else (None, None)
    window = torch.stack(losses[-LOSS_WINDOW:]).float().mean().item() if losses else math.nan
    timed_s = end - timed_from if step > 1 else end - start
    measured = samples - timed_samples if step > 1 else samples
    summary = TrainSummary(
        task=task.name,
        device=str(rt.device),
        plan=rt.explain(),
        steps=step,
        epochs=round(epoch_float, 3),
        samples=samples,
        final_loss=window,
        val_loss=val_loss,
        val_metric=val_metric,
        samples_per_s=measured / timed_s if timed_s > 0 else math.nan,
        train_seconds=end - start,
        compile_seconds=rt.compile_seconds,
        sample=task.sample(model) if task.sample else None,
    )
    if out_dir is not None:
        save_weights(Path(out_dir) / "model.safetensors", model)
        write_json(Path(out_dir) / "summary.json", summary.to_dict())
    return summary


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, rt: Runtime, batch_size: int) -> tuple[float, float | None]:
    """Return the mean validation loss and metric, weighting each batch by its size."""
    assert task.val_data is not None
    was_training = model.training
    model.eval()
    total_loss, total_metric, count = 0.0, 0.0, 0
    for batch in DataLoader(task.val_data, batch_size=batch_size):
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
    if count == 0:
        return math.nan, None
    return total_loss / count, (total_metric / count if task.metric is not None else None)


def _generator(config: TrainConfig) -> torch.Generator | None:
    seed = config.runtime.get("seed")
    return torch.Generator().manual_seed(seed) if seed is not None else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
