"""What an out-of-memory the Trainer did not recover from tells the user: a way out that works where it struck."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import redline
from redline.errors import OutOfMemory
from redline.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from oom_models import ForwardLimit, oom_task, out_of_memory


class StateTooLarge(torch.optim.AdamW):
    """AdamW on a device too small for its state: the first step, which allocates it, runs out of memory."""

    def step(self, closure=None):
        raise out_of_memory(0)


class RunsOutLater(ForwardLimit):
    """Runs out of memory from its ``fail_from``-th training forward on, at any size: a batch that grew."""

    fail_from = 3

    def __init__(self) -> None:
        super().__init__(None)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        if self.training and self.calls >= self.fail_from:
            raise out_of_memory(x.shape[0])
        return super().forward(x)


def trainer(task: redline.Task, micro_batch, **config) -> Trainer:
    options = redline.RuntimeOptions(devices="cpu", compile="off", precision="fp32", seed=0, micro_batch=micro_batch)
    return Trainer(task, runtime=options, max_steps=4, trial="off", progress=False, **config)


@pytest.mark.parametrize("micro_batch", [None, "auto"])
def test_an_out_of_memory_in_the_optimizers_step_points_past_micro_batches(micro_batch):
    """Before, it hinted --micro-batch auto (already on, or no help there) or a smaller batch, which hold as much."""
    task = dataclasses.replace(oom_task(limit=None), optimizer=lambda params: StateTooLarge(params, lr=1e-2))
    with pytest.raises(OutOfMemory) as caught, trainer(task, micro_batch) as run:
        run.fit()
    message = str(caught.value)
    assert message.startswith("step 1: the device ran out of memory: OutOfMemoryError: CUDA out of memory")
    hint = message.split("\nhint: ", 1)[1]
    assert hint.startswith("it ran out in the optimizer's step, where neither micro-batches nor a smaller batch help")
    assert "--strategy fsdp" in hint and "`redline memory --task SPEC`" in hint
    assert "--micro-batch auto" not in hint and "lower --batch-size" not in hint


def test_a_whole_batch_out_of_memory_hints_micro_batches_and_once_kept_a_resume_with_them(tmp_path):
    """Before, the kept note said to run the same command with --resume auto (out of memory again at the same
    place) beside "lower --batch-size", which a resumed run refuses (its checkpoint's batch size stays)."""
    task = dataclasses.replace(oom_task(limit=None), model=RunsOutLater)
    with pytest.raises(OutOfMemory) as caught, trainer(task, None) as run:
        run.fit()
    assert str(caught.value).endswith("losing no step; or lower --batch-size")  # nothing kept: a smaller batch helps
    with pytest.raises(OutOfMemory) as caught, trainer(task, None, out_dir=tmp_path) as run:
        run.fit()
    saved = tmp_path / "checkpoints" / "step-00000002"
    hint = str(caught.value).split("\nhint: ", 1)[1]
    assert hint == (
        "--micro-batch auto (micro_batch='auto') splits the batch in halves on out-of-memory and redoes it by gradient "
        f"accumulation, losing no step; the steps so far are saved in {saved}: then run the same command with "
        "--resume auto --micro-batch auto (a resumed run keeps its batch size: its micro-batches are what can shrink)"
    )
    RunsOutLater.fail_from = 10**6  # the resumed run's micro-batches fit
    try:
        with trainer(task, "auto", out_dir=tmp_path, resume="auto") as run:
            assert run.fit().steps == 4
    finally:
        RunsOutLater.fail_from = 3


def test_a_kept_out_of_memory_with_auto_on_says_a_resume_alone_runs_out_again(tmp_path):
    task = dataclasses.replace(oom_task(limit=None), model=RunsOutLater)
    said = "even one sample does not fit"
    with pytest.raises(OutOfMemory, match=said) as caught, trainer(task, "auto", out_dir=tmp_path) as run:
        run.fit()
    assert str(caught.value).endswith(
        f"the steps so far are saved in {tmp_path / 'checkpoints' / 'step-00000002'}: a resumed run (--resume auto) "
        "keeps their batch size and precision, so the same command would run out of memory again"
    )
    assert "--micro-batch auto" not in str(caught.value)
