"""A step whose micro-batches span an epoch's end (grad_accum) holds that epoch's evaluation: a checkpoint of the
step's start, written by a failure or by early stopping there, resumes into the run an unbroken one is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.errors import TrainingError
from redline.train.callbacks import EarlyStopping
from redline.train.trainer import Trainer


def task(fail_at: int = 0) -> redline.Task:
    """40 samples in batches of 16: with grad_accum 2, step 2 is epoch 0's last batch and epoch 1's first. Its batch
    norm's running statistics move in every micro-batch's forward: a dropped one's must be put back."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 8, generator=gen), torch.randint(0, 2, (40,), generator=gen))
    val = TensorDataset(torch.randn(16, 8, generator=gen), torch.randint(0, 2, (16,), generator=gen))
    calls = [0]

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == fail_at:
                raise RuntimeError("a failure in the step that spans the epoch's end")
        return nn.functional.cross_entropy(outputs, targets)

    return redline.Task(
        model=lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)), loss_fn=loss,
        train_data=data,
        val_data=val, batch_size=16, epochs=4, optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5),
    )  # fmt: skip


def fit(task: redline.Task, out: Path, **kwargs: object) -> redline.TrainSummary:
    options = redline.RuntimeOptions(devices="cpu", seed=0, precision="fp32", compile="off", grad_accum=2)
    with Trainer(task, runtime=options, progress=False, out_dir=out, log_every=1, **kwargs) as trainer:
        return trainer.fit()


def same_run(a: Path, b: Path) -> None:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(value, second[name]) for name, value in first.items())
    assert (a / "eval.jsonl").read_text() == (b / "eval.jsonl").read_text()


def test_a_failure_inside_the_step_spanning_an_epochs_end_resumes_into_the_unbroken_run(tmp_path: Path) -> None:
    # The checkpoint held the step's start with the schedule after the epoch's evaluation: resumed, the plateau
    # schedule stepped on that evaluation twice (lr 0.025 where the unbroken run kept 0.05)
    fit(task(), tmp_path / "unbroken")
    with pytest.raises(TrainingError, match="step-00000001"):
        fit(task(fail_at=5), tmp_path / "broken")
    fit(task(), tmp_path / "broken", resume="auto")
    same_run(tmp_path / "unbroken", tmp_path / "broken")


def test_early_stopping_inside_a_step_resumes_with_more_patience_into_the_unbroken_run(tmp_path: Path) -> None:
    # It checkpointed the epoch's end with the step's first micro-batch dropped (skipped on resume) and warned
    # "rt.save at 1 of the 2 batches of a step", advice for a loop of the user's own
    def stopping(patience: int) -> list[EarlyStopping]:
        return [EarlyStopping(patience=patience, min_delta=10.0)]  # no evaluation improves enough

    stopped = fit(task(), tmp_path / "stopped", callbacks=stopping(2))  # at epoch 2's end, inside step 5
    assert (stopped.stopped, stopped.steps) == ("early stopping", 4)
    fit(task(), tmp_path / "stopped", callbacks=stopping(50), resume="auto")
    fit(task(), tmp_path / "unbroken", callbacks=stopping(50))
    same_run(tmp_path / "unbroken", tmp_path / "stopped")
