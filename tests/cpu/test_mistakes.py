"""A newcomer's mistakes end in a redline error that names the problem and the fix, through the API and the CLI."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

from redline import Runtime, RuntimeOptions
from redline.errors import ConfigError, RedlineError, TaskError, TrainingError
from redline.runtime.loss import check_loss
from redline.task import Task
from redline.train.callbacks import Callback, EarlyStopping
from redline.train.config import TrainerConfig
from redline.train.data import plan_length
from redline.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from mistake_tasks import mistake

TASKS = Path(__file__).parent / "mistake_tasks.py"
SPEC = f"{TASKS}:mistake"

# kind -> (error type, what the message must say)
MISTAKES = {
    "bare_tensor": (TaskError, r"each item of train_data must be a pair \(inputs, targets\); the loader gave Tensor"),
    "triple": (TaskError, r"must be a pair .* a 3-tuple \(Tensor\(8, 4\) float32, Tensor\(8, 1\) float32"),
    "val_triple": (
        TaskError,
        r"each item of val_data must be a pair.*\nhint: return .*TensorDataset\(x, y\) does\)$",
    ),
    "dict_collate": (TaskError, r"must be a pair .* gave \{'x': .*\nhint: the collate_fn builds each batch: return \("),
    "loss_per_sample": (TaskError, r"loss_fn\(outputs, targets\) returned a tensor of shape \(8,\); expected a scalar"),
    "loss_number": (TaskError, r"returned float 1\.0; expected a scalar tensor"),
    "loss_detached": (TaskError, r"does not depend on the model's parameters \(requires_grad=False\)"),
    "metric_text": (TaskError, r"task\.metric\(outputs, targets\) returned str 'good'; expected a number"),
    "no_params": (ConfigError, r"the model \(NoParams\) has no parameters"),
    "listed_layers": (ConfigError, r"\(ListedLayers\) has no parameters.*nn\.ModuleList"),
    "buffers_only": (ConfigError, r"\(BuffersOnly\) has no parameters.*buffers \(weight\).*nn\.Parameter"),
    "key_error": (
        TrainingError,
        r"step 1: the model or loss raised KeyError: 'pixels'.*mistake_tasks\.py:\d+ in forward",
    ),
    "attribute_error": (TrainingError, r"raised AttributeError: .*'head'.*mistake_tasks\.py:\d+ in forward"),
    "type_error": (TrainingError, r"raised TypeError: .*mask.*\n  batch: inputs Tensor\(8, 4\) float32"),
    "broken_init": (
        TrainingError,
        r"task 'broken_init': building the model .* raised AttributeError: .*'width'\n  at .*mistake_tasks\.py:\d+ "
        r"in __init__",
    ),
    "dataset_error": (
        TrainingError,
        r"reading a batch of the data raised KeyError: 'item \d+ has no label'\n  at .*mistake_tasks\.py",
    ),
    "val_dataset_error": (TrainingError, r"reading a batch of the data raised KeyError: 'item \d+ has no label'"),
    "tuple_outputs": (
        TrainingError,
        r"step 1: loss_fn\(outputs, targets\) raised AttributeError: 'tuple' .*\n  batch: .*\n  outputs: "
        r"\(Tensor\(8, 1\) float32, Tensor\(8, 4\) float32\)\nhint: the model returned a tuple.* \(outputs\[0\], say\)",
    ),
    "dict_outputs": (
        TrainingError,
        r"step 1: loss_fn\(outputs, targets\) raised AttributeError: 'dict' .*\n  outputs: \{'pred': Tensor\(8, 1\) "
        r"float32, 'features': .*\nhint: the model returned a dict, .* \(outputs\['pred'\], say\)",
    ),
}


@pytest.mark.parametrize("kind", MISTAKES)
def test_a_mistake_is_a_redline_error_with_the_fix(kind):
    error, message = MISTAKES[kind]
    with pytest.raises(error, match=f"(?s){message}") as caught, Trainer(mistake(kind), max_steps=2) as trainer:
        trainer.fit()
    assert "\nhint: " in str(caught.value)


STEP_MISTAKES = [
    "key_error",
    "attribute_error",
    "type_error",
    "loss_per_sample",
    "loss_number",
    "loss_detached",
    "dataset_error",
]


@pytest.mark.parametrize("kind", STEP_MISTAKES)
def test_a_mistake_met_first_by_the_precision_trial_is_said_as_the_run_says_it(kind, monkeypatch, tmp_path):
    """The trial, which runs the model before step 1, let a KeyError or AttributeError of the user's escape bare."""
    monkeypatch.setenv("REDLINE_CPU", "amx")  # auto measures bf16 against fp32 before the first step
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    error, message = MISTAKES[kind]  # the trial measures nothing, and step 1 says it as without a trial
    with pytest.raises(error, match=f"(?s){message}") as caught, Trainer(mistake(kind), max_steps=2, trial="on") as t:
        t.fit()
    assert "\nhint: " in str(caught.value)


def test_a_bug_in_the_users_code_keeps_its_traceback_for_the_python_api():
    with pytest.raises(TrainingError) as caught, Trainer(mistake("key_error"), max_steps=2) as trainer:
        trainer.fit()
    assert isinstance(caught.value.__cause__, KeyError)


def test_a_stream_with_no_length_trains_by_steps_and_refuses_epochs():
    with Trainer(mistake("stream"), max_steps=7, progress=False) as trainer:
        summary = trainer.fit()  # 40 items of batch 8: the stream runs dry after 5 steps and starts again
    assert (summary.steps, summary.samples, summary.stopped, summary.epochs) == (7, 56, "max_steps", None)
    with pytest.raises(ConfigError, match=r"(?s)train_data is a stream \(Stream has no length\).*--max-steps"):
        Trainer(mistake("stream"), max_epochs=2).fit()


def test_a_stream_that_has_a_length_trains_by_epochs():
    class Sized(IterableDataset):  # a stream that says how many items a pass yields, as torch's DataLoader reads it
        def __iter__(self):
            return iter(mistake("stream").train_data)

        def __len__(self):
            return 40

    task = dataclasses.replace(mistake("stream"), train_data=Sized())
    with Trainer(task, max_epochs=2, progress=False) as trainer:
        summary = trainer.fit()  # 40 items of batch 8: 5 steps an epoch
    assert (summary.steps, summary.samples, summary.stopped, summary.epochs) == (10, 80, "epochs", 2.0)


class ReadOnce(IterableDataset):
    """A stream whose __iter__ hands out one iterator: used up by the first pass, empty from then on."""

    def __init__(self, items: list) -> None:
        self.items = iter(items)

    def __iter__(self):
        return self.items


@pytest.mark.parametrize("items", [range(40), []], ids=["read-once", "empty"])
def test_a_val_stream_that_gives_nothing_is_named_not_logged_as_a_nan_loss(items):
    task = mistake("ok")
    pairs = [(task.train_data[i][0], task.train_data[i][1]) for i in items]
    stream = dataclasses.replace(task, val_data=ReadOnce(pairs))
    # the read-once stream is used up by the evaluation at step 2; one that gives nothing is the user's to fix
    expected = r"(?s)evaluation at step \d: val_data gave no item.*hint: .*__iter__"
    with pytest.raises(TaskError, match=expected), Trainer(stream, max_steps=6, eval_every=2, progress=False) as run:
        run.fit()


def test_a_train_stream_used_up_by_its_first_epoch_names_its_iter():
    task = mistake("ok")
    stream = dataclasses.replace(task, train_data=ReadOnce([task.train_data[i] for i in range(40)]))
    # 40 items of batch 8: epoch 1 is 5 steps; the same iterator then gives nothing
    expected = r"(?s)train_data gave no batch in epoch 2, after batches.*same iterator.*hint: .*__iter__.*generator"
    with pytest.raises(TaskError, match=expected), Trainer(stream, max_steps=8, progress=False) as run:
        run.fit()
    empty = dataclasses.replace(task, train_data=ReadOnce([]))
    with (
        pytest.raises(TaskError, match=r"gave no batch in epoch 1: the stream is empty\n"),
        Trainer(empty, max_steps=8) as run,
    ):
        run.fit()


def test_a_train_stream_used_up_keeps_the_epochs_before_in_a_checkpoint_to_resume_from(tmp_path):
    task = mistake("ok")
    items = [task.train_data[i] for i in range(40)]
    stream = dataclasses.replace(task, train_data=ReadOnce(items))
    saved = str(tmp_path / "checkpoints" / "step-00000005")
    with pytest.raises(TaskError, match=rf"(?s)epoch 2.*the steps so far are saved in {saved}: then run the same") as e:
        Trainer(stream, max_steps=8, out_dir=tmp_path, progress=False).fit()
    assert str(e.value).count("the steps so far are saved") == 1, str(e.value)  # said once, not by each layer

    class Fixed(IterableDataset):  # a fresh pass each time
        def __iter__(self):
            return iter(items)

    fixed = dataclasses.replace(task, train_data=Fixed())
    summary = Trainer(fixed, max_steps=8, out_dir=tmp_path, resume="auto", progress=False).fit()
    assert (summary.steps, summary.resumed_from) == (8, saved)  # the first epoch's 5 steps were not lost
    logged = [row.split(",")[0] for row in (tmp_path / "metrics.csv").read_text().splitlines()[1:]]
    assert logged == [str(step) for step in range(1, 9)]  # each step logged once


def test_a_resumed_stream_goes_on_where_it_stopped(tmp_path):
    # With dropout: the stream's loader drew its seed from torch's global RNG as each pass began, after the
    # resumed run had restored it, so every later dropout mask moved by one draw.
    task = dataclasses.replace(
        mistake("stream"), model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    )
    seeded = {"progress": False, "runtime": RuntimeOptions(seed=0)}
    with Trainer(task, max_steps=7, out_dir=tmp_path / "whole", **seeded) as trainer:
        trainer.fit()
    with Trainer(task, max_steps=3, out_dir=tmp_path / "halves", **seeded) as trainer:
        trainer.fit()
    with Trainer(task, max_steps=7, out_dir=tmp_path / "halves", resume="auto", **seeded) as trainer:
        resumed = trainer.fit()
    assert resumed.steps == 7 and resumed.samples == 56
    whole = (tmp_path / "whole" / "model.safetensors").read_bytes()
    assert (tmp_path / "halves" / "model.safetensors").read_bytes() == whole


def test_too_little_data_for_the_processes_names_the_sizes():
    data = mistake("short").train_data  # one item; a batch of 2 split across 2 processes needs two
    with pytest.raises(TaskError, match=r"(?s)train_data holds 1 item\(s\), not one batch of 2 split across 2.*hint"):
        plan_length(data, batch_size=2, world_size=2, grad_accum=1, max_epochs=1, max_steps=None)
    assert plan_length(data, batch_size=2, world_size=1, grad_accum=1, max_epochs=3, max_steps=None) == (3, 1)


def test_a_batch_larger_than_the_data_is_said_once_not_claimed(caplog):
    data = torch.utils.data.TensorDataset(torch.zeros(5, 2), torch.zeros(5))
    with caplog.at_level("WARNING", logger="redline"):
        assert plan_length(data, batch_size=8, world_size=1, grad_accum=1, max_epochs=2, max_steps=None) == (2, 1)
    assert "train_data holds 5 items, fewer than a batch of 8: every batch is the whole set of 5" in caplog.text
    assert "--batch-size 5" in caplog.text
    caplog.clear()
    plan_length(data, batch_size=5, world_size=1, grad_accum=1, max_epochs=2, max_steps=None)
    assert caplog.text == ""


def test_a_step_spanning_epochs_is_said(caplog):
    # --grad-accum 8 over 4 batches an epoch made each step take every sample twice, without a word.
    data = torch.utils.data.TensorDataset(torch.zeros(32, 2), torch.zeros(32))  # 4 batches of 8 an epoch
    with caplog.at_level("WARNING", logger="redline"):
        assert plan_length(data, batch_size=8, world_size=1, grad_accum=8, max_epochs=math.inf, max_steps=3)[0] == 3
    assert (
        "grad_accum=8 takes 8 batches for each optimizer step, and an epoch of train_data holds 4: each " in caplog.text
    )
    assert "step spans 2 epochs" in caplog.text and "hint: lower --grad-accum to 4 or less" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="redline"):
        plan_length(data, batch_size=8, world_size=1, grad_accum=4, max_epochs=math.inf, max_steps=3)
        # the Trainer's second count, once a compiled run drops its partial batch: said once, by the first
        plan_length(data, batch_size=8, world_size=1, grad_accum=8, max_epochs=math.inf, max_steps=3, drop_last=True)
    assert "spans" not in caplog.text


def test_batches_grad_accum_leaves_without_a_step_at_the_runs_end_are_said(caplog):
    data = torch.utils.data.TensorDataset(torch.zeros(40, 2), torch.zeros(40))  # 5 batches of 8 an epoch
    with caplog.at_level("WARNING", logger="redline"):
        assert plan_length(data, batch_size=8, world_size=1, grad_accum=2, max_epochs=1, max_steps=None) == (2, 5)
    assert "grad_accum=2: the run's 5 batches (1 epoch(s) of 5) make 2 optimizer steps, and its last 1" in caplog.text
    assert "hint: pass a --grad-accum that divides 5" in caplog.text
    caplog.clear()
    plan_length(data, batch_size=8, world_size=1, grad_accum=2, max_epochs=2, max_steps=None)  # 10 batches: 5 steps
    plan_length(data, batch_size=8, world_size=1, grad_accum=2, max_epochs=1, max_steps=1)  # max_steps ends it
    plan_length(data, batch_size=8, world_size=1, grad_accum=2, max_epochs=math.inf, max_steps=3)
    assert caplog.text == ""


def test_batches_grad_accum_leaves_without_a_step_are_said_once_by_rank_0(caplog):
    # the warning came twice (the tuned Plan's look-up counts the steps first, asking for no warning) and on every rank
    data = torch.utils.data.TensorDataset(torch.zeros(40, 2), torch.zeros(40, 1))  # 5 batches of 8 an epoch
    with caplog.at_level("WARNING", logger="redline"):
        plan_length(data, batch_size=8, world_size=1, grad_accum=2, max_epochs=1, max_steps=None, warn=False)
    assert caplog.text == ""
    task = Task(model=lambda: nn.Linear(2, 1), loss_fn=nn.functional.mse_loss, train_data=data, batch_size=8, epochs=1)
    config = TrainerConfig(runtime=RuntimeOptions(grad_accum=2), trial="off", progress=False)
    with caplog.at_level("WARNING", logger="redline"):
        Trainer(task, config).fit()
    assert caplog.text.count("are not trained on") == 1


def test_samples_count_the_batch_axis_of_the_inputs_not_the_keys_of_the_targets():
    with Trainer(mistake("dict_targets"), max_steps=4, progress=False) as trainer:
        summary = trainer.fit()
    assert summary.samples == 4 * 8


def test_samples_count_every_micro_batch():
    options = {"max_steps": 3, "progress": False}
    with Trainer(mistake(), runtime=RuntimeOptions(grad_accum=2), **options) as trainer:
        summary = trainer.fit()
    assert summary.samples == 3 * 2 * 8


def test_the_epoch_column_names_the_epoch_each_step_ran_in(tmp_path):
    # 40 items of batch 8: 5 steps an epoch; windows of 3 steps straddle the epoch's end
    with Trainer(mistake(), max_epochs=2, log_every=3, out_dir=tmp_path, progress=False) as trainer:
        summary = trainer.fit()
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = [(int(row["step"]), int(row["epoch"])) for row in csv.DictReader(file)]
    assert rows == [(step, (step - 1) // 5) for step in range(1, 11)]
    assert (summary.steps, summary.epochs, summary.samples, summary.stopped) == (10, 2.0, 80, "epochs")


def test_max_steps_alone_decides_the_length_over_the_tasks_epochs():
    with Trainer(mistake(), max_steps=12, progress=False) as trainer:  # the task's one epoch is 5 steps
        summary = trainer.fit()
    assert (summary.steps, summary.stopped) == (12, "max_steps")
    with Trainer(mistake(), max_steps=12, max_epochs=1, progress=False) as trainer:
        assert trainer.fit().stopped == "epochs"


def test_early_stopping_without_validation_data_is_refused():
    with pytest.raises(ConfigError, match=r"(?s)has no val_data.*hint: give the Task val_data"):
        Trainer(mistake(), callbacks=[EarlyStopping()])


def test_early_stopping_on_a_metric_the_task_does_not_have_is_refused_before_training():
    import dataclasses

    from mistake_tasks import X, Y
    from torch.utils.data import TensorDataset

    task = dataclasses.replace(mistake(), val_data=TensorDataset(X, Y))  # val_loss only: no metric
    # before, it trained up to the first evaluation, then said val_metric was not among ['val_loss', 'val_metric']
    with pytest.raises(ConfigError) as raised:
        Trainer(task, callbacks=[EarlyStopping(monitor="val_metric")])
    assert "watches val_metric, and task 'ok' has no metric: its evaluation reports val_loss alone" in str(raised.value)
    assert "hint: watch val_loss (--early-stopping-monitor val_loss), or give the Task metric=" in str(raised.value)


def test_a_finished_run_rerun_is_left_exactly_as_it_was(tmp_path, caplog):
    with Trainer(mistake(), max_steps=4, out_dir=tmp_path, progress=False) as trainer:
        first = trainer.fit()
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with Trainer(mistake(), max_steps=4, out_dir=tmp_path, progress=False, resume="auto") as trainer:
        again = trainer.fit()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == files
    assert again.to_dict() == json.loads(files["summary.json"])
    assert again.steps == first.steps == 4 and again.final_loss == pytest.approx(first.final_loss)
    assert "ended at step 4 (stopped: max_steps)" in caplog.text and "raise --max-steps" in caplog.text
    with Trainer(mistake(), max_steps=6, out_dir=tmp_path, progress=False, resume="auto") as trainer:
        assert trainer.fit().steps == 6  # a higher limit trains on


def test_a_run_killed_after_its_last_checkpoint_writes_its_results_on_resume_without_a_step_more(tmp_path):
    import dataclasses

    from mistake_tasks import X, Y
    from torch.utils.data import TensorDataset

    task = dataclasses.replace(mistake(), val_data=TensorDataset(X, Y))
    with Trainer(task, max_steps=4, out_dir=tmp_path, progress=False) as trainer:
        trainer.fit()
    weights = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "summary.json").unlink()  # killed after the last checkpoint, before the summary was written
    with Trainer(task, max_steps=4, out_dir=tmp_path, progress=False, resume="auto") as trainer:
        again = trainer.fit()  # before, it trained a step 5 past --max-steps 4 to write the summary
    assert again.steps == 4 and again.stopped == "max_steps"
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 4
    assert (tmp_path / "model.safetensors").read_bytes() == weights
    steps = [int(row["step"]) for row in csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines())]
    evals = [int(row["step"]) for row in csv.DictReader((tmp_path / "eval.csv").read_text().splitlines())]
    assert steps == [1, 2, 3, 4] and evals == [4]  # the final evaluation once, not once per attempt


def test_a_summary_the_disk_refuses_is_a_clear_error_and_the_rerun_writes_it(tmp_path, monkeypatch):
    import errno

    import redline.atomic as atomic

    write_atomic = atomic.write_atomic

    def disk_full_for_the_summary(path, write):
        if path.name == "summary.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write_atomic(path, write)

    monkeypatch.setattr(atomic, "write_atomic", disk_full_for_the_summary)
    with pytest.raises(TrainingError) as raised:
        Trainer(mistake(), max_steps=4, out_dir=tmp_path, progress=False).fit()
    assert str(raised.value).startswith(f"{tmp_path / 'summary.json'} could not be written: No space left on device")
    assert "hint: free space on that disk" in str(raised.value) and "again with --resume auto" in str(raised.value)
    monkeypatch.undo()
    with Trainer(mistake(), max_steps=4, out_dir=tmp_path, progress=False, resume="auto") as trainer:
        assert trainer.fit().steps == 4  # what the hint says: the results are written
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 4


def test_a_checkpoint_the_disk_refuses_is_a_clear_error_that_leaves_the_earlier_ones(tmp_path, monkeypatch):
    import errno

    import redline.checkpoint.whole as whole

    save = whole.save_object

    def disk_full_on_the_second_checkpoint(obj, path):
        if ".tmp-step-00000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        save(obj, path)

    monkeypatch.setattr(whole, "save_object", disk_full_on_the_second_checkpoint)
    with pytest.raises(RedlineError) as raised:
        Trainer(mistake(), max_steps=4, checkpoint_every=2, out_dir=tmp_path, progress=False).fit()
    root = tmp_path / "checkpoints"
    message = str(raised.value)
    assert message.startswith(f"{root / 'step-00000004'}: the checkpoint could not be written: No space left on device")
    assert f"the checkpoints committed before it under {root} are intact" in message
    assert "hint: free space on that disk" in message and "--resume auto" in message
    assert sorted(path.name for path in root.iterdir()) == ["step-00000002"]  # no half-written staging directory
    monkeypatch.undo()
    with Trainer(mistake(), max_steps=4, out_dir=tmp_path, progress=False, resume="auto") as trainer:
        summary = trainer.fit()
    assert summary.steps == 4 and summary.resumed_from == str(root / "step-00000002")


def test_weights_the_disk_refuses_are_a_clear_error_that_leaves_the_earlier_file(tmp_path, monkeypatch):
    import errno

    import redline.atomic as atomic

    def disk_full(path, write):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    (tmp_path / "model.safetensors").write_bytes(b"the earlier weights")
    monkeypatch.setattr(atomic, "write_atomic", disk_full)
    with Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        with pytest.raises(RedlineError, match=r"model.safetensors: the weights could not be written: No space left"):
            rt.save_weights(tmp_path / "model.safetensors")
    assert (tmp_path / "model.safetensors").read_bytes() == b"the earlier weights"


TINY_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline

def make():
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    return redline.Task(model=lambda: nn.Linear(8, 2), loss_fn=nn.functional.cross_entropy,
                        train_data=TensorDataset(x, y), batch_size=8, name="tiny")
"""


def test_train_nproc_refuses_an_earlier_runs_checkpoints_before_any_worker_a_restart_would_let_go_on(
    tmp_path, monkeypatch
):
    # Only the workers' first attempt refused: torchrun restarted the refused worker (--max-restarts), the restart
    # went on from the earlier run's newest checkpoint, and the job exited 0.
    import torch.distributed.run
    from typer.testing import CliRunner

    from redline.cli.main import app

    def never_start(args: object) -> None:
        raise AssertionError("workers started")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.py").write_text(TINY_TASK)
    earlier = CliRunner().invoke(app, ["train", "--task", "tasks.py:make", "--max-steps", "4", "--out", "run",
                                       "--checkpoint-every", "2", "--no-progress"])  # fmt: skip
    assert earlier.exit_code == 0, earlier.output
    monkeypatch.setattr(torch.distributed.run, "run", never_start)
    launch = ["train", "--task", "tasks.py:make", "--nproc", "2", "--max-restarts", "1", "--out", "run"]
    new = CliRunner().invoke(app, launch)
    assert isinstance(new.exception, ConfigError), new.output
    assert "holds a finished run's checkpoints (the newest at step 4, where it ended; stopped: max_steps)" in str(
        new.exception
    )
    assert "hint: to train that run further, pass --resume 'auto' with a larger --max-steps N" in str(new.exception)
    branch = CliRunner().invoke(app, [*launch, "--resume", "run/checkpoints/step-00000002"])  # its steps past 2
    assert isinstance(branch.exception, ConfigError), branch.output
    assert "holds checkpoints past step 2 (at 4)" in str(branch.exception)


def test_a_new_run_among_the_checkpoints_of_a_run_that_had_not_ended_says_to_continue_it(tmp_path):
    with Trainer(mistake(), max_steps=4, checkpoint_every=2, out_dir=tmp_path, progress=False) as trainer:
        trainer.fit()
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000004")  # as if it were killed after step 2's checkpoint
    with pytest.raises(ConfigError) as refused:
        Trainer(mistake(), max_steps=4, out_dir=tmp_path, progress=False).fit()
    assert str(refused.value) == (
        f"out_dir={str(tmp_path)!r} is not allowed; expected a directory of its own: it holds an earlier run's "
        "checkpoints (the newest at step 2), and a new run there would mix its checkpoints and logs with that run's"
        "\nhint: continue that run with resume='auto', or pass another out_dir=DIR; to start over, delete "
        f"{tmp_path / 'checkpoints'} and the logs beside it (metrics.csv, metrics.jsonl)"
    )


def killed_run(out: Path, rows: int) -> dict[str, bytes]:
    """An out_dir a SIGKILLed run left before its first checkpoint: ``rows`` steps logged, and its lock; its files."""
    out.mkdir(parents=True)
    (out / ".lock").write_text("")
    (out / "metrics.csv").write_text("step,loss\n" + "".join(f"{i},2.3\n" for i in range(1, rows + 1)))
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "loss": 2.3}}\n' for i in range(1, rows + 1)))
    (out / "eval.csv").write_text("step,val_loss,val_metric\n")
    return {p.name: p.read_bytes() for p in out.iterdir()}


def test_a_new_run_among_the_logs_of_a_run_killed_before_its_first_checkpoint_is_refused_and_leaves_them(tmp_path):
    """Before, the new run replaced metrics.csv's 70 rows with its own 5, with no word."""
    files = killed_run(tmp_path / "run", 70)
    with pytest.raises(ConfigError) as refused:
        Trainer(mistake(), max_steps=5, out_dir=tmp_path / "run", progress=False).fit()
    assert str(refused.value) == (
        f"out_dir={str(tmp_path / 'run')!r} is not allowed; expected a directory of its own: it holds an earlier "
        "run's logs (metrics.csv, metrics.jsonl) and no checkpoint (that run stopped before its first, or its "
        "checkpoints were deleted), which a new run there would replace\nhint: pass another out_dir=DIR; to start "
        "over there, pass resume='auto' (it finds no checkpoint and replaces those logs) or delete them (nothing was "
        "written: they are as they were)"
    )
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == files
    from typer.testing import CliRunner

    from redline.cli.main import app

    (tmp_path / "tasks.py").write_text(TINY_TASK)
    said = CliRunner().invoke(app, ["train", "--task", f"{tmp_path / 'tasks.py'}:make", "--max-steps", "2",
                                    "--out", str(tmp_path / "run"), "--no-progress"])  # fmt: skip
    assert isinstance(said.exception, ConfigError), said.output
    assert str(said.exception).startswith(f"--out={str(tmp_path / 'run')!r} is not allowed")
    assert "hint: pass another --out DIR; to start over there, pass --resume 'auto' (it finds" in str(said.exception)
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == files


@pytest.mark.parametrize("logger", ["csv", "jsonl"])
def test_a_rerun_where_a_run_stopped_on_a_nan_loss_replaces_its_logs(tmp_path, logger):
    """The NaN's hint says to lower the learning rate and run again: that rerun was refused as among a killed run's logs
    (the stopped run wrote rows and no checkpoint)."""
    steps = {"n": 0}

    def diverging(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        steps["n"] += out.device.type != "meta" and torch.is_grad_enabled()
        loss = nn.functional.mse_loss(out, y)
        # an inf of finite gradients: the window's later rows are finite, its last row among them
        return loss + (math.inf - loss.detach()) if steps["n"] == 3 else loss

    task = dataclasses.replace(mistake(), loss_fn=diverging)
    with pytest.raises(TrainingError, match="step 3: the loss is inf"):
        Trainer(task, max_steps=5, log_every=5, loggers=[logger], out_dir=tmp_path, progress=False).fit()
    assert Trainer(mistake(), max_steps=2, loggers=[logger], out_dir=tmp_path, progress=False).fit().steps == 2
    log = (tmp_path / f"metrics.{logger}").read_text().splitlines()
    assert len(log) == (3 if logger == "csv" else 2) and "inf" not in "".join(log).lower()


def test_logs_of_a_header_alone_are_replaced_and_resume_auto_starts_over_among_a_killed_runs_logs(tmp_path):
    killed_run(tmp_path / "header", 0)  # a run that failed before its first log
    assert Trainer(mistake(), max_steps=2, out_dir=tmp_path / "header", progress=False).fit().steps == 2
    killed_run(tmp_path / "auto", 70)  # --resume auto, as a requeued job runs: it finds no checkpoint, starts over
    assert Trainer(mistake(), max_steps=2, out_dir=tmp_path / "auto", resume="auto", progress=False).fit().steps == 2
    for out in ("header", "auto"):
        assert [row["step"] for row in csv.DictReader((tmp_path / out / "metrics.csv").open())] == ["1", "2"]


def test_a_new_run_among_an_earlier_runs_checkpoints_is_refused_and_leaves_them(tmp_path):
    with Trainer(mistake(), max_steps=4, out_dir=tmp_path, progress=False) as trainer:
        trainer.fit()
    files = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    # before, the new run pruned by step number: its own step 2 went, the earlier run's step 4 stayed for --resume
    with pytest.raises(ConfigError, match=r"(?s)holds a finished run's checkpoints \(the newest at step 4, where it "
                       r"ended; stopped: max_steps\).*hint: .*resume='auto' with a larger max_steps=N"):  # fmt: skip
        Trainer(mistake(), max_steps=2, keep_checkpoints=1, out_dir=tmp_path, progress=False).fit()
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files
    with Trainer(mistake(), max_steps=6, out_dir=tmp_path, progress=False, resume="auto") as trainer:
        assert trainer.fit().steps == 6  # continuing it is what the hint says


def test_a_resume_at_another_batch_size_is_refused_before_it_repeats_samples(tmp_path):
    with Trainer(mistake(), max_steps=2, out_dir=tmp_path, progress=False) as trainer:
        trainer.fit()  # 2 batches of 8 of the epoch's 40 items
    # before, the resumed epoch skipped 2 batches of 4: the samples 8..15 came again, and the epoch count was off
    with pytest.raises(ConfigError, match=r"(?s)step-00000002 was written with batches of 8, and this run's are 4.*"
                       r"repeat or skip samples\nhint: resume with --batch-size 8"):  # fmt: skip
        Trainer(mistake(), max_steps=4, batch_size=4, out_dir=tmp_path, resume="auto", progress=False).fit()
    with Trainer(mistake(), max_steps=4, out_dir=tmp_path, resume="auto", progress=False) as trainer:
        summary = trainer.fit()
    assert (summary.samples, summary.epochs) == (4 * 8, 0.8)


def test_the_summary_is_strict_json_when_a_figure_is_missing(tmp_path):
    with Trainer(mistake(), max_steps=1, out_dir=tmp_path, progress=False) as trainer:
        summary = trainer.fit()
    assert summary.samples_per_s is None  # no step after the first was timed

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    data = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    assert data["samples_per_s"] is None and math.isfinite(data["final_loss"])


# -- through the command line: exit 2, the message, no traceback ---------------------------------


@pytest.mark.parametrize("kind", MISTAKES)
def test_the_cli_says_the_mistake_in_one_message(kind, redline_here):
    result = redline_here("train", "--task", SPEC, "--task-arg", f"kind={kind}", "--max-steps", "2", "--no-progress")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    message = " ".join(result.stderr.split())  # rich may wrap the message's lines
    expected = " ".join(MISTAKES[kind][1].replace("\\n", " ").split())
    assert re.search(expected.replace(" ", r"\s*"), message), message
    assert "hint:" in message


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--clip-grad-norm", "0"), "--clip-grad-norm=0.0 is not allowed; expected a number > 0\n"),
        (("--logger", "wandb"), "--logger='wandb' is not allowed; expected one of 'csv', 'jsonl', 'tensorboard'"),
        (("--logger", "tensorboard"), "logger 'tensorboard' writes its files under out_dir, and out_dir is None"),
        (("--logger", "jsonl"), "logger 'jsonl' writes its files under out_dir, and out_dir is None"),
        (("--early-stopping-patience", "2"), "early stopping watches a validation metric, and task 'ok' has no"),
        (
            ("--strategy", "ddp"),
            "--strategy='ddp' is not allowed; expected it in the processes `redline launch` starts",
        ),
        (("--eval-every", "2"), "--eval-every=2 is not allowed; expected it with a task that has val_data (task 'ok'"),
    ],
)
def test_the_cli_refuses_a_bad_option_before_training(flags, message, redline_here):
    result = redline_here("train", "--task", SPEC, "--max-steps", "2", "--no-progress", *flags)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr and "hint:" in result.stderr


def test_redline_traceback_prints_the_users_traceback_before_the_message(redline_here):
    args = ("train", "--task", SPEC, "--task-arg", "kind=key_error", "--max-steps", "2", "--no-progress")
    result = redline_here(*args, env={"REDLINE_TRACEBACK": "1"})
    assert result.returncode == 2
    traceback_text, message = result.stderr.split("error: step 1:", 1)
    assert "Traceback (most recent call last)" in traceback_text and "KeyError: 'pixels'" in traceback_text
    assert 'return self.fc(inputs["pixels"])' in traceback_text and "hint:" in message


def test_the_cli_reruns_a_finished_run_without_touching_it(tmp_path, redline_here):
    args = ("train", "--task", SPEC, "--max-steps", "3", "--out", str(tmp_path), "--no-progress", "--json")
    first = redline_here(*args)
    assert first.returncode == 0, first.stderr
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    again = redline_here(*args, "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == files
    assert json.loads(again.stdout) == json.loads(first.stdout)
    assert "ended at step 3 (stopped: max_steps)" in " ".join(again.stderr.split())


def test_the_cli_trains_a_stream_and_counts_its_samples(redline_here):
    result = redline_here("train", "--task", SPEC, "--task-arg", "kind=stream", "--max-steps", "6", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["steps"], summary["samples"], summary["epochs"]) == (6, 48, None)


def test_errors_are_redline_errors():
    for error in (TaskError, TrainingError):
        assert issubclass(error, RedlineError) and error.exit_code == 2


def test_the_runtime_refuses_a_loss_it_cannot_back_propagate_and_a_model_with_nothing_to_train():
    with Runtime(devices="cpu") as rt:
        model, _ = rt.setup(nn.Linear(4, 1), lambda params: torch.optim.SGD(params, lr=0.1))
        per_sample = (model(torch.randn(8, 4)) ** 2).squeeze(1)
        with pytest.raises(TaskError, match=r"(?s)backward\(loss\) got a tensor of shape \(8,\).*hint: reduce"):
            rt.backward(per_sample)
        with pytest.raises(TaskError, match=r"backward\(loss\) got int 3; expected a scalar tensor"):
            rt.backward(3)  # type: ignore[arg-type]
        # a Hugging Face style model's outputs.loss, None when the batch had no labels
        with pytest.raises(TaskError, match=r"(?s)backward\(loss\) got None; expected a scalar tensor.*labels="):
            rt.backward(None)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"none of the model's \(Linear\) 2 parameter tensors requires"):
            rt.setup(nn.Linear(4, 1).requires_grad_(False), lambda params: torch.optim.SGD(params, lr=0.1))
    assert check_loss(torch.tensor(1.0), training=False).item() == 1.0  # evaluation needs no gradient


class SignalAt(Callback):
    """Send this process SIGTERM once step ``at`` has been logged (as a scheduler would, mid-run)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step(self, trainer, step, loss):
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_during_the_last_step_ends_the_run_as_finished_not_interrupted():
    with Trainer(mistake(), max_steps=4, log_every=1, progress=False, callbacks=[SignalAt(3)]) as trainer:
        last = trainer.fit()  # the signal is seen after step 4, the last: the work is done
    assert (last.steps, last.stopped) == (4, "max_steps")
    with Trainer(mistake(), max_steps=4, log_every=1, progress=False, callbacks=[SignalAt(1)]) as trainer:
        early = trainer.fit()
    assert (early.steps, early.stopped) == (2, "signal SIGTERM")


@pytest.mark.parametrize("rank", [0, 1])
def test_the_job_wide_warnings_of_a_resume_and_of_the_data_are_said_by_rank_0_alone(tmp_path, caplog, rank):
    # Under `train --nproc N` each of these came N times: every rank said them.
    import logging

    from redline.checkpoint import open_checkpoint
    from redline.parallel.env import DistEnv
    from redline.train import resume
    from redline.train.state import Position

    fp32 = RuntimeOptions(devices="cpu", precision="fp32")
    with Trainer(mistake(), max_steps=4, out_dir=tmp_path, progress=False, runtime=fp32) as trainer:
        trainer.fit()
    found = open_checkpoint("auto", tmp_path / "checkpoints")
    env = DistEnv(rank=rank, world_size=2)
    with caplog.at_level(logging.WARNING, logger="redline"):
        resume.resumed_options(RuntimeOptions(devices="cpu", precision="bf16-mixed"), found, env)  # the Plan's fp32
        resume.warn_unsaved(found, None, env)  # resumed without --out
        resume.ended_run(Position(step=4), "max_steps", total=4, max_epochs=1, max_steps=4, out_dir=tmp_path, env=env)
        plan_length(list(range(3)), batch_size=8, world_size=1, grad_accum=1, max_epochs=1, max_steps=None,
                    warn=rank == 0)  # fmt: skip
    said = [record.getMessage().split("\n")[0] for record in caplog.records]
    assert len(said) == (4 if rank == 0 else 0), said


@pytest.mark.parametrize(("batch", "world", "told"), [(64, 3, "1, 2 or 4 processes"), (7, 2, "1 or 7 processes")])
def test_a_resume_into_processes_its_batch_does_not_split_across_names_the_counts_it_does(batch, world, told):
    # It said "expected a multiple of 3 ... e.g. --batch-size 66", and with 66, "resume with --batch-size 64".
    from types import SimpleNamespace

    from redline.train.state import Position

    found = SimpleNamespace(path=Path("run/checkpoints/step-00000040"))
    with pytest.raises(
        ConfigError, match=re.escape(f"batches of {batch}, which do not split across {world} processes")
    ) as e:
        Position(step=40, batch_size=batch).check_batch_size(batch, found, world_size=world)  # type: ignore[arg-type]
    assert f"hint: resume in {told} (--nproc)" in str(e.value)
    Position(step=40, batch_size=batch).check_batch_size(batch, found, world_size=1)  # type: ignore[arg-type]
    # another batch asked (the task's default): it said "resume with --batch-size 7", which --nproc 2 refuses
    with pytest.raises(ConfigError, match=re.escape(f"hint: resume in {told} (--nproc)")):
        Position(step=40, batch_size=batch).check_batch_size(batch + 1, found, world_size=world)  # type: ignore[arg-type]
