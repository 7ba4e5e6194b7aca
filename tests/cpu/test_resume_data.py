"""A resumed run goes on over the data it began with: another training set is refused, another task is named."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from small_tasks import small
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.checkpoint import CheckpointError
from redline.errors import ConfigError
from redline.train.agreement import data_digests
from redline.train.state import Position
from redline.train.trainer import Trainer


def task(samples: int = 64, name: str = "pairs") -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, 4, generator=gen), torch.randint(0, 2, (samples,), generator=gen))
    return redline.Task(
        model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1), name=name,
    )  # fmt: skip


def fit(task: redline.Task, out: Path, steps: int, **kwargs: object) -> redline.TrainSummary:
    options = redline.RuntimeOptions(devices="cpu", seed=0)
    with Trainer(task, runtime=options, progress=False, max_steps=steps, out_dir=out, **kwargs) as trainer:
        return trainer.fit()


def test_a_resume_on_a_training_set_of_another_length_is_refused_naming_both(tmp_path: Path) -> None:
    # It went on silently: the stored "batch 6 of epoch 0" fell past the shorter epoch's end, into the next.
    fit(task(64), tmp_path, 6)
    with pytest.raises(ConfigError) as refused:
        fit(task(40), tmp_path, 10, resume="auto")
    message = str(refused.value)
    assert re.search(r"step-00000006 was written training on 64 samples of task 'pairs', and this run's train_data "
                     r"holds 40", message)  # fmt: skip
    assert "hint: resume with the task and --task-arg options the run began with" in message
    assert "start a new run (another --out)" in message
    assert fit(task(64), tmp_path, 10, resume="auto").steps == 10  # the same data goes on


def test_a_checkpoint_of_another_tasks_model_names_both_tasks(tmp_path: Path) -> None:
    # It named the tensors that differ and blamed "another --task-arg, or changed model code", not the other task.
    fit(task(name="pairs"), tmp_path, 2)
    wider = dataclasses.replace(task(name="wider"), model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    with pytest.raises(CheckpointError) as refused:
        fit(wider, tmp_path, 4, resume="auto")
    message = str(refused.value)
    assert "the checkpoint's model differs from this run's model: missing from the checkpoint: 0.weight" in message
    assert (
        "; it was written by task 'pairs', and this run trains task 'wider'\nhint: resume with the task the run "
        in message
    )
    with pytest.raises(CheckpointError) as same_task:  # a task of the same name: the options or the code changed
        fit(dataclasses.replace(wider, name="pairs"), tmp_path, 4, resume="auto")
    assert "written by task" not in str(same_task.value) and "another --task-arg" in str(same_task.value)


def test_a_resume_under_another_task_name_warns_and_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fit(task(name="pairs"), tmp_path, 4)
    with caplog.at_level(logging.WARNING, logger="redline"):
        assert fit(task(name="others"), tmp_path, 8, resume="auto").steps == 8
    assert "written by task 'pairs', with task 'others'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="redline"):  # its own checkpoints now name the task it went on as
        fit(task(name="others"), tmp_path, 10, resume="auto")
    assert "written by task" not in caplog.text


@pytest.mark.parametrize(
    ("stored", "now"),
    [(Position(step=6, batch_size=8), 40), (Position(step=6, batch_size=8, train_samples=64, task="pairs"), None)],
    ids=["a checkpoint from before the length was saved", "a stream without a length"],
)
def test_a_length_unknown_on_either_side_is_not_checked(stored: Position, now: int | None) -> None:
    found = SimpleNamespace(path=Path("run/checkpoints/step-00000006"))
    stored.check_resume(found, batch_size=8, split=1, world_size=1, task="pairs", train_samples=now, data_hashes={})  # type: ignore[arg-type]
    assert (stored.task, stored.train_samples) == ("pairs", now)  # its next checkpoint holds this run's


def test_the_checkpoint_keeps_the_data_apart_from_the_position_an_older_redline_reads(tmp_path: Path) -> None:
    # An older redline builds Position(**extra["position"]): a field it does not know ended it with a TypeError.
    fit(task(64), tmp_path, 3)
    extra = torch.load(tmp_path / "checkpoints" / "step-00000003" / "extra.pt", weights_only=True)
    assert set(extra["position"]) == {"step", "epoch", "batches_in_epoch", "samples", "batch_size"}
    assert extra["data"] == {"train_samples": 64, "task": "pairs"}
    assert extra["data_hashes"] == data_digests(task(64)) and set(extra["data_hashes"]) == {"train_data"}
    assert Position.from_state(extra) == Position(step=3, batches_in_epoch=3, samples=24, batch_size=8,
                                                  train_samples=64, task="pairs",
                                                  data_hashes=extra["data_hashes"])  # fmt: skip
    del extra["data"], extra["data_hashes"]  # one written before the data was saved: nothing to check against
    assert Position.from_state(extra).train_samples is None and Position.from_state(extra).data_hashes == {}


def fit_small(out: Path, steps: int, **kwargs: object) -> redline.TrainSummary:
    split = {name: kwargs.pop(name) for name in ("split_seed", "val_seed") if name in kwargs}
    options = redline.RuntimeOptions(devices="cpu", seed=0, micro_batch=kwargs.pop("micro_batch", None))
    with Trainer(small(**split), runtime=options, progress=False, max_steps=steps, out_dir=out, **kwargs) as trainer:
        return trainer.fit()


def test_a_resume_on_a_split_moved_to_other_samples_as_many_is_refused_saying_how_to_go_on(tmp_path: Path) -> None:
    # `--task-arg seed=7` on a run begun with seed 0 went on silently: it validated on samples it had trained on.
    fit_small(tmp_path, 5, split_seed=0)
    with pytest.raises(ConfigError) as refused:
        fit_small(tmp_path, 10, split_seed=7, resume="auto")
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'checkpoints' / 'step-00000005'} was written training on other samples of "
                              "task 'small' than this run's train_data holds: as many, but a hash of a few of their "
                              "items differs")  # fmt: skip
    assert (
        "hint: resume with the same --task-arg values as the run it resumes (in Python: the Task built as it was, a "
        "split drawn at random under the same seed)" in message
    )
    assert "to train on this data, start a new run (another --out)" in message
    assert fit_small(tmp_path, 10, split_seed=0, resume="auto").steps == 10  # the same split goes on


def test_a_run_without_a_seed_resumed_on_other_samples_goes_on_saying_why_and_to_seed(tmp_path: Path, caplog) -> None:
    # A task drawing its data at random, in a run without --seed: no command could draw that run's samples again,
    # and `--resume auto`, which an interrupted run is told to run, was refused naming --task-arg values never given
    def unseeded(split_seed: int) -> redline.TrainSummary:
        options = redline.RuntimeOptions(devices="cpu", seed=None)
        task = small(split_seed=split_seed)
        with Trainer(task, runtime=options, progress=False, max_steps=10, out_dir=tmp_path, resume="auto") as trainer:
            return trainer.fit()

    with Trainer(small(split_seed=0), runtime=redline.RuntimeOptions(devices="cpu", seed=None), progress=False,
                 max_steps=5, out_dir=tmp_path) as trainer:  # fmt: skip
        trainer.fit()
    with caplog.at_level(logging.WARNING, logger="redline"):
        assert unseeded(split_seed=7).steps == 10
    assert "written training on other samples than this run's train_data holds" in caplog.text
    assert "that run had no seed, so a task drawing its data at random drew other samples here" in caplog.text
    assert "hint: give --seed (in Python: RuntimeOptions(seed=...)" in caplog.text
    assert "written validating on other samples" not in caplog.text  # said once, with the training samples


def test_a_resume_validating_on_other_samples_alone_warns_and_goes_on(tmp_path: Path, caplog) -> None:
    fit_small(tmp_path, 5)
    with caplog.at_level(logging.WARNING, logger="redline"):
        assert fit_small(tmp_path, 10, val_seed=5, resume="auto").steps == 10
    assert "written validating on other samples than this run's val_data holds" in caplog.text
    assert "hint: resume with the same --task-arg values as the run it resumes" in caplog.text


def test_the_data_is_told_by_the_whole_set_so_a_resume_in_micro_batches_goes_on(tmp_path: Path) -> None:
    fit_small(tmp_path, 5)
    assert fit_small(tmp_path, 10, resume="auto", micro_batch=8).steps == 10


def test_hashes_unknown_on_either_side_are_not_checked() -> None:
    found = SimpleNamespace(path=Path("run/checkpoints/step-00000006"))
    for stored, now in (({}, {"train_data": "b"}), ({"train_data": "a"}, {})):  # an older checkpoint; a set not read
        position = Position(step=6, batch_size=8, train_samples=64, task="pairs", data_hashes=stored)
        position.check_resume(found, batch_size=8, split=1, world_size=1, task="pairs", train_samples=64,  # type: ignore[arg-type]
                              data_hashes=now)  # fmt: skip
        assert position.data_hashes == now  # its next checkpoint holds this run's


SPLIT_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline


def make(split_seed: int = 0, lr: float = 0.1, samples: int = 64) -> redline.Task:
    data = torch.randn(96, 4, generator=torch.Generator().manual_seed(7))
    order = torch.randperm(96, generator=torch.Generator().manual_seed(split_seed))  # the split moves with the option
    x, y = data[order[:samples]], (data[order[:samples], 0] > 0).long()
    return redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy,
                        train_data=TensorDataset(x, y), batch_size=8,
                        optimizer=lambda params: torch.optim.SGD(params, lr=lr), name="split")
"""


def unseeded_fit(task: redline.Task, out: Path, steps: int, **kwargs: object) -> redline.TrainSummary:
    with Trainer(task, runtime=redline.RuntimeOptions(devices="cpu"), progress=False, max_steps=steps, out_dir=out,
                 **kwargs) as trainer:  # fmt: skip
        return trainer.fit()


def test_a_resume_whose_task_option_moved_the_data_is_refused_naming_the_option_though_the_run_had_no_seed(
    tmp_path: Path,
) -> None:
    # A run without --seed was only warned of ("that run had no seed ... give --seed"), though --task-arg
    # split_seed=1, not the seed, drew the other samples, and the run's own options draw them again.
    spec = tmp_path / "split_task.py"
    spec.write_text(SPLIT_TASK)
    unseeded_fit(redline.load_task(f"{spec}:make"), tmp_path / "run", 4)
    with pytest.raises(ConfigError) as refused:
        unseeded_fit(redline.load_task(f"{spec}:make", split_seed=1), tmp_path / "run", 8, resume="auto")
    said = str(refused.value)
    assert "the task's options differ from that run's: split_seed=1 (the run began without it: the factory's " in said
    assert "hint: resume with the --task-arg values the run began with" in said
    # an option that leaves the data alone is not the data's business: a changed lr resumes (as train warns it)
    summary = unseeded_fit(redline.load_task(f"{spec}:make", lr=0.05), tmp_path / "run", 8, resume="auto")
    assert summary.steps == 8
    # its checkpoints keep the options the run began with: the lr this resume took its checkpoint's over is no
    # option the run began with ("lr left to the factory's default (the run began with lr=0.05)" sent users to it)
    with pytest.raises(ConfigError) as again:
        unseeded_fit(redline.load_task(f"{spec}:make", split_seed=1), tmp_path / "run", 12, resume="auto")
    assert "differ from that run's: split_seed=1 (the run began without it: the factory's default);" in str(again.value)
    # a training set of another length names the options too
    with pytest.raises(ConfigError) as shorter:
        unseeded_fit(redline.load_task(f"{spec}:make", samples=48), tmp_path / "run", 12, resume="auto")
    said = str(shorter.value)
    assert "written training on 64 samples of task 'split', and this run's train_data holds 48 (and the task's " in said
    assert "options differ from that run's: samples=48 (the run began without it: the factory's default)):" in said


def test_changed_options_name_each_side():
    from redline.train.state import changed_options

    assert changed_options({"seed": "0", "n": "3"}, {"seed": "1", "m": "'a'"}) == (
        "m='a' (the run began without it: the factory's default), "
        "n left to the factory's default (the run began with n=3), seed=1 (the run began with seed=0)"
    )
    assert changed_options(None, {"seed": "1"}) == "" and changed_options({"seed": "0"}, {"seed": "0"}) == ""
