"""A resumed run follows the LR schedule its task builds now, from the checkpoint's progress: a cosine or a one-cycle
schedule sized for a run made longer, a changed step size, a plateau's patience. Its learning rates from the resume
on are those of a run that began with the new settings; changed settings are named in a warning."""

from __future__ import annotations

import csv
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as lr
from torch.utils.data import TensorDataset

import redline
from redline.errors import TrainingError
from redline.train.schedule import Schedule
from redline.train.trainer import Trainer

Factory = Callable[[torch.optim.Optimizer], Any]


def task(scheduler: Factory | None, *, val: bool = False) -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen))
    return redline.Task(
        model=lambda: nn.Linear(4, 1), loss_fn=nn.functional.mse_loss, train_data=data, batch_size=8,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), scheduler=scheduler,
        val_data=data if val else None, metric=(lambda outputs, targets: 0.0) if val else None,
    )  # fmt: skip


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)


def rates(schedule: Schedule, steps: range) -> list[tuple[float, ...]]:
    """The learning rate and momentum each of ``steps`` applies, stepped as the Trainer steps it."""
    seen = []
    for step in steps:
        group = schedule.scheduler.optimizer.param_groups[0]
        seen.append((group["lr"], group["momentum"]))
        schedule.scheduler.optimizer.step()
        schedule.after_step(step)
    return seen


def resumed(before: Factory, after: Factory, at: int, caplog: pytest.LogCaptureFixture) -> Schedule:
    """A schedule built by ``after`` and loaded, as a resumed run loads it, from one built by ``before`` ``at`` steps
    in (its optimizer's state first)."""
    first = Schedule.build(task(before), optimizer())
    rates(first, range(1, at + 1))
    saved = first.scheduler.optimizer.state_dict(), first.state_dict()
    schedule = Schedule.build(task(after), optimizer())
    schedule.scheduler.optimizer.load_state_dict(saved[0])
    with caplog.at_level(logging.WARNING, logger="redline"):
        schedule.load_state_dict(saved[1], steps=at, source="ckpt/step-00000010")
    return schedule


def sequential(o: torch.optim.Optimizer, length: int) -> lr.SequentialLR:
    warmup = lr.LinearLR(o, start_factor=0.1, total_iters=3)
    return lr.SequentialLR(o, [warmup, lr.CosineAnnealingLR(o, T_max=length - 3)], milestones=[3])


KINDS: dict[str, tuple[Callable[[int], Factory], str]] = {
    "cosine": (lambda n: lambda o: lr.CosineAnnealingLR(o, T_max=n), "T_max 20, the checkpoint's 10"),
    "one cycle": (lambda n: lambda o: lr.OneCycleLR(o, max_lr=0.5, total_steps=n), "total_steps 20"),
    "step": (lambda n: lambda o: lr.StepLR(o, step_size=n // 4, gamma=0.5), "step_size 5, the checkpoint's 2"),
    "warm restarts": (lambda n: lambda o: lr.CosineAnnealingWarmRestarts(o, T_0=n // 4, T_mult=2), "T_0 5"),
    "sequential": (lambda n: lambda o: sequential(o, n), "scheduler 1's T_max 17, the checkpoint's 7"),
    "chained": (
        lambda n: lambda o: lr.ChainedScheduler([lr.ExponentialLR(o, 0.9), lr.StepLR(o, n // 4, 0.5)]),
        "scheduler 1's step_size 5",
    ),
    "cyclic": (lambda n: lambda o: lr.CyclicLR(o, 0.01, 0.1, step_size_up=n // 4), "total_size 10.0"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_schedule_resized_for_a_longer_run_goes_on_as_one_built_so_from_the_start(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The checkpoint's settings were loaded over the new ones: a cosine resized from 10 to 20 steps ran at lr 0 at
    # step 11 and climbed back; OneCycleLR failed at step 11 however the task sized it
    sized, changed = KINDS[kind]
    schedule = resumed(sized(10), sized(20), 10, caplog)
    unbroken = Schedule.build(task(sized(20)), optimizer())
    expected = rates(unbroken, range(1, 21))[10:]
    assert rates(schedule, range(11, 21)) == expected
    assert f"ckpt/step-00000010: this run's LR scheduler ({type(schedule.scheduler).__name__}) has " in caplog.text
    assert changed in caplog.text and "the resumed run follows this run's" in caplog.text


def test_a_schedule_with_the_same_settings_loads_as_it_was_saved_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sized = KINDS["one cycle"][0]
    schedule = resumed(sized(20), sized(20), 10, caplog)
    unbroken = Schedule.build(task(sized(20)), optimizer())
    assert rates(schedule, range(11, 21)) == rates(unbroken, range(1, 21))[10:]
    assert caplog.text == ""


def test_a_lambda_schedule_follows_its_new_functions_from_the_resumed_step(caplog: pytest.LogCaptureFixture) -> None:
    def linear(n: int) -> Factory:
        return lambda o: lr.LambdaLR(o, lambda step: 1 - step / n)

    schedule = resumed(linear(10), linear(20), 8, caplog)
    assert rates(schedule, range(9, 13)) == rates(Schedule.build(task(linear(20)), optimizer()), range(1, 13))[8:]
    assert (
        "this run's LR scheduler (LambdaLR) has lr_lambdas give lr 0.06 at step 8, the checkpoint's 0.02" in caplog.text
    )
    caplog.clear()
    resumed(linear(20), linear(20), 8, caplog)
    assert caplog.text == ""


def test_a_plateau_keeps_its_progress_under_its_new_settings(caplog: pytest.LogCaptureFixture) -> None:
    first = Schedule.build(task(lambda o: lr.ReduceLROnPlateau(o, patience=1, factor=0.5), val=True), optimizer())
    for loss in (1.0, 2.0, 2.0, 0.5, 0.7):  # one reduction (lr 0.05), then a best of 0.5 and one bad evaluation
        first.after_evaluation({"val_loss": loss})
    saved = first.scheduler.optimizer.state_dict(), first.state_dict()

    def load(**settings: Any) -> lr.ReduceLROnPlateau:
        schedule = Schedule.build(task(lambda o: lr.ReduceLROnPlateau(o, **settings), val=True), optimizer())
        schedule.scheduler.optimizer.load_state_dict(saved[0])
        with caplog.at_level(logging.WARNING, logger="redline"):
            schedule.load_state_dict(saved[1], steps=5, source="ckpt")
        return schedule.scheduler

    plateau = load(patience=4, factor=0.1)
    assert (plateau.patience, plateau.factor) == (4, 0.1)
    assert (plateau.best, plateau.num_bad_epochs, plateau.last_epoch) == (0.5, 1, 5)
    assert plateau.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert "factor 0.1, the checkpoint's 0.5; patience 4, the checkpoint's 1" in caplog.text
    watching_another_way = load(mode="max")  # a best loss is no best metric: judged afresh
    assert (watching_another_way.best, watching_another_way.num_bad_epochs) == (-float("inf"), 0)


def fit(out: Path, scheduler: Factory, max_steps: int, **kwargs: object) -> list[float]:
    options = redline.RuntimeOptions(devices="cpu", seed=0, precision="fp32", compile="off")
    with Trainer(task(scheduler), runtime=options, progress=False, out_dir=out, max_steps=max_steps, **kwargs) as t:
        t.fit()
    with (out / "metrics.csv").open() as rows:
        return [float(row["lr"]) for row in csv.DictReader(rows)]


def test_a_run_resumed_longer_with_its_one_cycle_resized_trains_to_the_end(tmp_path: Path) -> None:
    # The task's total_steps=14 was loaded over with the checkpoint's 10: "Tried to step 11 times", as the hint
    # said to fix by what had been done
    def one_cycle(n: int) -> Factory:
        return lambda o: lr.OneCycleLR(o, max_lr=0.5, total_steps=n)

    fit(tmp_path / "run", one_cycle(10), 10)
    with pytest.raises(TrainingError, match=r"(?s)Tried to step 11 times.*resume with the schedule sized for"):
        fit(tmp_path / "run", one_cycle(10), 14, resume="auto")
    rates_resumed = fit(tmp_path / "run", one_cycle(14), 14, resume="auto")
    assert rates_resumed[10:] == fit(tmp_path / "unbroken", one_cycle(14), 14)[10:]


def test_errors_md_quotes_the_warning(caplog: pytest.LogCaptureFixture) -> None:
    sized = KINDS["cosine"][0]
    resumed(sized(10), sized(20), 10, caplog)
    page = (Path(__file__).resolve().parents[2] / "docs" / "errors.md").read_text(encoding="utf-8")
    quoted = re.search(r"\*\*`warning: \.\.\./(step-00000010: this run's LR scheduler .+?)`\*\*", page)
    assert quoted is not None
    assert caplog.records[0].getMessage().split("\nhint:")[0] == f"ckpt/{quoted[1]}"
