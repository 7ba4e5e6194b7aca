"""A second run with the same Trainer, or the same callbacks, starts afresh: nothing of the first decides it."""

import csv
import dataclasses
import functools
import json
import time
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


def frozen_task(lr: float = 0.0) -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=gen), torch.randint(0, 2, (64,), generator=gen))
    return redline.Task(
        model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, val_data=data,
        batch_size=8, epochs=50, optimizer=lambda params: torch.optim.SGD(params, lr=lr),
    )  # fmt: skip


def quiet(task: redline.Task, **kwargs) -> Trainer:
    return Trainer(task, runtime=redline.RuntimeOptions(devices="cpu", seed=0), progress=False, **kwargs)


def test_a_second_fit_gives_early_stopping_its_whole_patience_again():
    trainer = quiet(frozen_task(), eval_every=2, callbacks=[EarlyStopping(monitor="val_loss", patience=2)])
    first, second = trainer.fit(), trainer.fit()
    assert (first.steps, first.stopped) == (6, "early stopping")  # evals at 2 (best), 4 and 6 without improvement
    assert (second.steps, second.stopped) == (6, "early stopping")  # not at 2, held to the first run's best


def test_one_early_stopping_shared_by_a_sweeps_runs_judges_each_by_its_own_evaluations():
    stopping = EarlyStopping(monitor="val_loss", patience=2)
    good = quiet(frozen_task(lr=0.5), eval_every=2, max_steps=8, callbacks=[stopping])
    assert good.fit().stopped == "max_steps"  # improving at each evaluation
    worse = quiet(frozen_task(), eval_every=2, callbacks=[stopping])
    assert worse.fit().steps == 6  # its own best at 2, then two evaluations without improvement


class FailsAt(redline.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_evaluate(self, trainer, step, metrics):
        if step == self.step:
            raise ValueError("the dashboard is down")


def test_a_callback_that_raises_mid_run_keeps_the_steps_before_it_and_the_run_resumes_from_them(tmp_path):
    def trainer(out, **kwargs) -> Trainer:
        return quiet(frozen_task(lr=0.5), max_steps=10, eval_every=4, out_dir=out, **kwargs)

    unbroken = trainer(tmp_path / "unbroken")
    unbroken.fit()
    with pytest.raises(
        TrainingError, match=r"callback FailsAt.on_evaluate raised ValueError: the dashboard is down"
    ) as e:
        trainer(tmp_path / "run", callbacks=[FailsAt(4)]).fit()
    saved = tmp_path / "run" / "checkpoints" / "step-00000004"
    assert f"the steps so far are saved in {saved}" in str(e.value) and isinstance(e.value.__cause__, ValueError)
    assert trainer(tmp_path / "run", resume="auto").fit().steps == 10
    for name, tensor in load_file(tmp_path / "unbroken" / "model.safetensors").items():
        assert torch.equal(load_file(tmp_path / "run" / "model.safetensors")[name], tensor), name


class Evaluations(redline.Callback):
    """Records the steps each evaluation ran at; raises at step ``fails_at``."""

    def __init__(self, fails_at: int | None = None) -> None:
        self.steps: list[int] = []
        self.fails_at = fails_at

    def on_evaluate(self, trainer, step, metrics):
        if step == self.fails_at:
            raise ConnectionError("the tracking server is down")
        self.steps.append(step)


def logged(out: Path) -> tuple[list[dict[str, str]], list[tuple[str, ...]]]:
    """The run's evaluation rows, and its training rows without their timings."""
    evals = list(csv.DictReader((out / "eval.csv").read_text().splitlines()))
    rows = csv.DictReader((out / "metrics.csv").read_text().splitlines())
    return evals, [(row["step"], row["epoch"], row["loss"], row["lr"]) for row in rows]


@pytest.mark.parametrize("verdict", ["stop", "go on"])
@pytest.mark.parametrize(
    ("eval_every", "grad_accum"), [(2, 1), (None, 1), (None, 3)], ids=["every-2", "each-epoch", "epoch-inside-a-step"]
)
def test_a_callback_that_raises_at_an_evaluation_resumes_to_stop_where_the_unbroken_run_does(
    tmp_path, eval_every, grad_accum, verdict
):
    """Early stopping judged after the callbacks: the steps kept missed the evaluation's verdict, and the resumed run
    stopped one evaluation late (at 6, not 4); an epoch's ReduceLROnPlateau stepped twice on the resumed run."""

    def trainer(out: Path, *callbacks: redline.Callback, **kwargs) -> Trainer:
        plateau = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0, threshold=1.0)
        task = dataclasses.replace(frozen_task(lr=0.5), scheduler=plateau)  # halves the rate at each evaluation
        stopping = EarlyStopping(monitor="val_loss", patience=2, min_delta=10.0)  # no evaluation improves by 10
        options = redline.RuntimeOptions(devices="cpu", seed=0, grad_accum=grad_accum)
        return Trainer(task, runtime=options, progress=False, eval_every=eval_every, log_every=1, out_dir=out,
                       keep_best="val_loss", callbacks=[*callbacks, stopping], **kwargs)  # fmt: skip

    seen = Evaluations()
    unbroken = trainer(tmp_path / "unbroken", seen).fit()
    assert unbroken.stopped == "early stopping" and len(seen.steps) == 3, seen.steps  # the best, then 2 worse
    fails_at = seen.steps[2] if verdict == "stop" else seen.steps[1]
    with pytest.raises(TrainingError, match="the tracking server is down"):
        trainer(tmp_path / "run", Evaluations(fails_at)).fit()
    resumed = trainer(tmp_path / "run", resume="auto").fit()
    assert (resumed.steps, resumed.stopped) == (unbroken.steps, "early stopping")
    assert logged(tmp_path / "run") == logged(tmp_path / "unbroken")  # the rates ReduceLROnPlateau set, too
    assert resumed.best == {**unbroken.best, "path": str(tmp_path / "run" / "best.safetensors")}
    for name, tensor in load_file(tmp_path / "unbroken" / "model.safetensors").items():
        assert torch.equal(load_file(tmp_path / "run" / "model.safetensors")[name], tensor), name


def test_a_callback_that_raises_without_out_dir_is_named_with_nothing_said_saved():
    with pytest.raises(TrainingError, match=r"callback FailsAt.on_evaluate raised ValueError") as e:
        quiet(frozen_task(), max_steps=10, eval_every=4, callbacks=[FailsAt(4)]).fit()
    assert "saved" not in str(e.value)


def test_a_sample_that_raises_after_training_leaves_the_weights_and_summary_written(tmp_path, caplog):
    def sample(model):
        raise ValueError("no prompt")

    task = dataclasses.replace(frozen_task(lr=0.1), sample=sample)
    with caplog.at_level("WARNING", logger="redline"):
        summary = quiet(task, max_steps=3, out_dir=tmp_path).fit()
    assert summary.steps == 3 and summary.sample is None
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "summary.json").is_file()
    said = caplog.text
    assert "task.sample raised ValueError: no prompt" in said and "test_trainer_again.py" in said
    assert "the summary and final weights are written without it" in said


@pytest.mark.parametrize("made", [12345, b"text", torch.ones(2)])
def test_a_sample_that_is_not_text_is_left_out_with_a_warning(tmp_path, caplog, made):
    # The summary's printing raised AttributeError ('int' object has no attribute 'translate') after the run,
    # and --json wrote the number as the sample.
    task = dataclasses.replace(frozen_task(lr=0.1), sample=lambda model: made)
    with caplog.at_level("WARNING", logger="redline"):
        summary = quiet(task, max_steps=2, out_dir=tmp_path).fit()
    assert summary.sample is None and json.loads((tmp_path / "summary.json").read_text())["sample"] is None
    assert f"task.sample returned a {type(made).__name__}, not text; the summary and final weights" in caplog.text
    assert "hint: return a str from task.sample" in caplog.text


def test_the_config_may_be_passed_by_name_and_a_rerun_of_a_finished_run_still_ends_its_fit(tmp_path):
    ended = []

    class Ends(redline.Callback):
        def on_fit_end(self, trainer, summary):
            ended.append(summary.steps)

    config = redline.TrainerConfig(max_steps=2, out_dir=tmp_path, progress=False)
    Trainer(frozen_task(), config=config, callbacks=[Ends()]).fit()  # by name: was TypeError, "multiple values"
    again = Trainer(frozen_task(), config=config, resume="auto", callbacks=[Ends()]).fit()  # left as it was
    assert again.steps == 2 and ended == [2, 2]


def test_a_module_given_as_the_model_stays_as_it_was_and_the_trained_one_is_the_trainers():
    module = nn.Linear(4, 2)
    before = module.weight.detach().clone()
    task = dataclasses.replace(frozen_task(lr=0.1), model=module)
    with quiet(task, max_steps=3) as trainer:
        trainer.fit()
        trained = trainer.model
    assert torch.equal(module.weight, before)  # every fit of the Task starts from these weights
    assert trained is not None and not torch.equal(trained.weight, before)


def test_predict_names_the_users_line_when_the_model_raises_and_takes_items_of_several_inputs_nested():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, inputs):
            a, b = inputs
            return self.linear(torch.cat([a, b], 1))

    rows = torch.randn(5, 4)
    task = dataclasses.replace(frozen_task(), model=Two, train_data=[((r[:2], r[2:]), 0) for r in rows], val_data=None)
    with quiet(task, max_steps=1) as trainer:
        trainer.fit()
        with pytest.raises(TrainingError, match=r"(?s)^predict: the model or loss raised ValueError: .*hint: check"):
            trainer.predict([(r[:2], r[2:]) for r in rows])  # read as (inputs, targets): the model gets a alone
        assert trainer.predict([((r[:2], r[2:]),) for r in rows]).shape == (5, 2)


class OutOfMemoryInEval(nn.Module):
    """Trains, then runs out of memory in its evaluations (as a model whose validation samples are larger)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        if not self.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return self.linear(x)


def test_an_out_of_memory_in_evaluation_is_an_error_that_says_so_not_torchs_traceback(tmp_path):
    from redline.errors import OutOfMemory
    from redline.train.config import TrainerConfig

    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    task = redline.Task(model=OutOfMemoryInEval, loss_fn=nn.functional.cross_entropy, train_data=data, val_data=data,
                        batch_size=8)  # fmt: skip
    config = TrainerConfig(max_steps=4, eval_every=2, progress=False, out_dir=tmp_path / "run", trial="off")
    with pytest.raises(OutOfMemory) as failed, Trainer(task, config) as trainer:
        trainer.fit()
    message = str(failed.value)
    assert message.startswith("val_data's first batch, after step 1: the device ran out of memory: "), "not at step 2"
    assert "evaluation runs val_data in batches of 8 without gradients" in message
    assert "--micro-batch does not split evaluation" in message and "step-00000001" in message, "the steps are kept"
    assert message.endswith("then run the same command with --resume auto (in Python: resume='auto')"), (
        "micro-batches split no evaluation"
    )


class FailsInTheSecondBatchOfAStep(nn.Module):
    """Raises in the 4th training forward: the second batch of step 2, with grad_accum 2."""

    def __init__(self):
        super().__init__()
        self.linear, self.calls = nn.Linear(4, 2), 0

    def forward(self, x):
        self.calls += self.training
        if self.calls == 4:
            raise ValueError("the model's bug (made up)")
        return self.linear(x)


def test_a_failure_amid_a_step_keeps_the_steps_before_it_without_a_warning_meant_for_a_users_loop(tmp_path, caplog):
    """The kept checkpoint warned 'rt.save at 1 of the 2 batches of a step ... save once rt.step returns True'."""
    from redline.train.config import TrainerConfig

    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    task = redline.Task(model=FailsInTheSecondBatchOfAStep, loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8)  # fmt: skip
    config = TrainerConfig(max_steps=4, progress=False, out_dir=tmp_path / "run", trial="off",
                           runtime=redline.RuntimeOptions(grad_accum=2))  # fmt: skip
    caught = caplog.at_level("WARNING", logger="redline")
    with caught, pytest.raises(TrainingError) as failed, Trainer(task, config) as trainer:
        trainer.fit()
    assert "step-00000001" in str(failed.value), "step 1 is kept, step 2's first batch left for the resume to redo"
    assert not [r for r in caplog.records if "rt.save at" in r.getMessage()]


class Slow(redline.Callback):
    """A callback that takes 90 ms at each step it is told of and each evaluation (a tracking server's round trip)."""

    def on_step(self, trainer, step, loss):
        time.sleep(0.09)

    def on_evaluate(self, trainer, step, metrics):
        time.sleep(0.09)


def test_time_in_the_callbacks_is_reported_apart_and_left_out_of_the_rates(tmp_path):
    """A callback's 0.3 s at each hook took samples/s from 194 to 27: the rates counted it as training."""
    task = frozen_task(lr=0.1)
    summary = quiet(task, max_steps=4, log_every=1, eval_every=2, out_dir=tmp_path, callbacks=[Slow()]).fit()
    assert summary.callback_seconds >= 0.09 * (4 + 2)  # told of 4 steps and 2 evaluations
    assert summary.samples_per_s is not None
    # the steps after the first, counted with the callbacks, would take their 0.54 s; a tiny model's take a few ms
    timed = 3 * task.batch_size / summary.samples_per_s
    assert timed < summary.callback_seconds / 3, f"{timed:.3f} s for 3 steps: a callback's time was counted"
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert sorted(float(row["step_time_ms"]) for row in rows[1:])[1] < 60  # the hook after a step is not the next's


@pytest.mark.parametrize(
    ("length", "said"),
    [
        ({"max_steps": 6}, "at each epoch's end (8 batches): 0 before step 6"),  # ends inside the first epoch
        ({"max_epochs": 3}, "at each epoch's end (8 batches): 2 before step 24"),  # the third is the last step's
        ({"max_steps": 6, "eval_every": 2}, "every 2 steps: 2 before step 6"),
        ({"max_steps": 7, "eval_every": 2}, None),  # at 2 (the best), 4 and 6 without improvement: stops at 6
        ({"max_epochs": 4}, None),
    ],
)
def test_early_stopping_that_cannot_end_the_run_is_warned_of_before_it_trains(caplog, length, said):
    stopping = EarlyStopping(monitor="val_loss", patience=2)
    with caplog.at_level("WARNING", logger="redline"):
        summary = quiet(frozen_task(), callbacks=[stopping], **length).fit()
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("early stopping")]
    if said is None:
        assert not warned and summary.stopped == "early stopping"
        return
    assert warned == [
        f"early stopping with patience 2 needs 3 evaluations before the run's last step to end it, and this run "
        f"evaluates {said}, so it runs to the end\nhint: evaluate more often (--eval-every N; eval_every=N in "
        "Python), train longer, or lower the patience (--early-stopping-patience)"
    ]
    assert summary.stopped != "early stopping"  # a warning, not a refusal: the run trains to its end


def test_callbacks_none_is_no_callbacks():
    """It was refused, with the hint 'pass callbacks=[NoneType(...)]'."""
    trainer = quiet(frozen_task(), max_steps=2, callbacks=None)
    assert (trainer.callbacks, trainer.early_stopping) == ([], None)
    assert trainer.fit().steps == 2
