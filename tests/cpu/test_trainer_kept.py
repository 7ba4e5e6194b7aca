"""A one-process run that fails mid-way keeps the steps it trained since its last checkpoint, and resumes from them
to the same weights as a run that never failed."""

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import redline
from redline.errors import TrainingError
from redline.train.failures import keep_steps
from redline.train.state import Position
from redline.train.trainer import Trainer


class Flaky(nn.Module):
    """A linear model whose training forward raises once, at its ``fail_at``-th call in this process."""

    calls = 0
    fail_at: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not x.is_meta:  # not the FLOP count's meta copy
            Flaky.calls += 1
            if Flaky.calls == Flaky.fail_at:
                raise ValueError("a cosmic ray")
        return self.lin(x)


class FlakyRows(Dataset):
    """Rows whose ``fail_at``-th read in this process raises (a file that went missing, once)."""

    def __init__(self, data: TensorDataset, fail_at: int | None) -> None:
        self.data, self.fail_at, self.reads = data, fail_at, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        self.reads += 1
        if self.reads == self.fail_at:
            raise OSError("the file server went away")
        return self.data[i]


@pytest.fixture(autouse=True)
def armed():
    Flaky.calls, Flaky.fail_at = 0, None
    yield
    Flaky.fail_at = None


def task(rows_fail_at: int | None = None) -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=gen), torch.randint(0, 2, (64,), generator=gen))
    return redline.Task(
        model=Flaky, loss_fn=nn.functional.cross_entropy, train_data=FlakyRows(data, rows_fail_at),
        batch_size=8, epochs=50, optimizer=lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
    )  # fmt: skip


def trainer(out, task: redline.Task, grad_accum: int = 1, **kwargs) -> Trainer:
    options = redline.RuntimeOptions(devices="cpu", seed=0, grad_accum=grad_accum, precision="fp32", compile=False)
    kwargs = {"max_steps": 10, **kwargs}
    return Trainer(task, runtime=options, progress=False, out_dir=out, trial="off", **kwargs)


def same_weights(a, b) -> None:
    for name, tensor in load_file(a / "model.safetensors").items():
        assert torch.equal(load_file(b / "model.safetensors")[name], tensor), name


def saved_steps(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_model_that_raises_mid_run_keeps_the_whole_steps_before_it_and_resumes_to_the_same_weights(
    tmp_path, grad_accum
):
    trainer(tmp_path / "unbroken", task(), grad_accum).fit()
    Flaky.calls, Flaky.fail_at = 0, 4 * grad_accum  # step 4's last micro-batch: three whole steps before it
    with pytest.raises(TrainingError, match=r"step 4: .*ValueError: a cosmic ray") as e:
        trainer(tmp_path / "run", task(), grad_accum).fit()
    saved = tmp_path / "run" / "checkpoints" / "step-00000003"
    assert f"the steps so far are saved in {saved}: then run the same command with --resume auto" in str(e.value)
    assert saved_steps(tmp_path / "run") == ["step-00000003"]
    assert isinstance(e.value.__cause__, ValueError)
    assert trainer(tmp_path / "run", task(), grad_accum, resume="auto").fit().steps == 10
    same_weights(tmp_path / "unbroken", tmp_path / "run")


def test_a_dataset_that_raises_mid_run_keeps_the_steps_before_it(tmp_path):
    trainer(tmp_path / "unbroken", task()).fit()
    with pytest.raises(TrainingError, match="reading a batch of the data raised OSError: the file server") as e:
        trainer(tmp_path / "run", task(rows_fail_at=8 * 5 + 3)).fit()  # inside step 6's batch
    assert f"the steps so far are saved in {tmp_path / 'run' / 'checkpoints' / 'step-00000005'}" in str(e.value)
    assert trainer(tmp_path / "run", task(), resume="auto").fit().steps == 10
    same_weights(tmp_path / "unbroken", tmp_path / "run")


def test_an_exception_not_redlines_own_passes_unchanged_and_the_saved_steps_are_told_in_a_warning(caplog):
    run = SimpleNamespace(
        in_optimizer_step=False, step_under_way=False, last_ckpt=None, pos=Position(7),
        put_back_evaluation=lambda: None,
    )  # fmt: skip

    def keep() -> str:
        run.last_ckpt = SimpleNamespace(path="ckpt/step-00000007", step=7)
        return "ckpt/step-00000007"

    exc = KeyError("layer")
    with caplog.at_level(logging.WARNING, logger="redline"):
        keep_steps(exc, run, keep)  # type: ignore[arg-type]
    assert exc.args == ("layer",)
    assert "the steps so far are saved in ckpt/step-00000007: then run the same command" in caplog.text


def test_a_failure_right_after_a_checkpoint_writes_no_second_one_and_names_that_one(tmp_path):
    Flaky.fail_at = 5  # step 5's forward, after step 4's checkpoint
    with pytest.raises(TrainingError, match="a cosmic ray") as e:
        trainer(tmp_path / "run", task(), checkpoint_every=4).fit()
    assert saved_steps(tmp_path / "run") == ["step-00000004"]
    assert f"the steps so far are saved in {tmp_path / 'run' / 'checkpoints' / 'step-00000004'}" in str(e.value)


def test_a_failure_before_the_first_step_and_one_without_out_dir_keep_nothing(tmp_path):
    Flaky.fail_at = 1
    with pytest.raises(TrainingError, match="a cosmic ray") as e:
        trainer(tmp_path / "run", task()).fit()
    assert "saved in" not in str(e.value) and saved_steps(tmp_path / "run") == []
    Flaky.calls, Flaky.fail_at = 0, 3
    with pytest.raises(TrainingError, match="a cosmic ray") as e:
        trainer(None, task()).fit()
    assert "saved in" not in str(e.value)


def test_a_failure_inside_the_optimizers_step_keeps_nothing(tmp_path):
    class Breaks(torch.optim.SGD):
        steps = 0

        def step(self, closure=None):
            Breaks.steps += 1
            if Breaks.steps == 4:
                raise RuntimeError("half way through the update")
            return super().step(closure)

    broken = dataclasses.replace(task(), optimizer=lambda params: Breaks(params, lr=0.5))
    with pytest.raises(RuntimeError, match="half way"):
        trainer(tmp_path / "run", broken).fit()
    assert saved_steps(tmp_path / "run") == []


@pytest.mark.parametrize(("eval_every", "steps"), [(None, [8, 16, 20]), (5, [5, 10, 15, 20])])
def test_an_evaluation_that_raises_is_run_again_by_the_resume_the_error_asks_for(tmp_path, eval_every, steps):
    # The kept checkpoint held the next epoch's start, or the step after the evaluation's, so the resumed run never
    # evaluated there: early stopping, a plateau schedule and --keep-best went on without it.
    broken, calls = [True], [0]

    def metric(outputs: torch.Tensor, targets: torch.Tensor) -> float:
        calls[0] += 1
        if broken[0] and calls[0] > 1:  # the first: val_data's first batch, evaluated after step 1
            raise ValueError("the metric's lookup table is missing")
        return float((outputs.argmax(1) == targets).float().mean())

    def with_val() -> redline.Task:
        gen = torch.Generator().manual_seed(1)
        val = TensorDataset(torch.randn(16, 4, generator=gen), torch.randint(0, 2, (16,), generator=gen))
        return dataclasses.replace(task(), val_data=val, metric=metric)

    def evaluated(out) -> list[int]:
        return [json.loads(line)["step"] for line in (out / "eval.jsonl").read_text().splitlines()]

    broken[0] = False
    trainer(tmp_path / "unbroken", with_val(), max_steps=20, eval_every=eval_every).fit()
    broken[0], calls[0] = True, 0
    with pytest.raises(TrainingError, match=rf"evaluation at step {steps[0]}") as e:
        trainer(tmp_path / "run", with_val(), max_steps=20, eval_every=eval_every).fit()
    assert "then run the same command with --resume auto (in Python: resume='auto')" in str(e.value)
    broken[0] = False
    assert trainer(tmp_path / "run", with_val(), max_steps=20, eval_every=eval_every, resume="auto").fit().steps == 20
    assert evaluated(tmp_path / "run") == evaluated(tmp_path / "unbroken") == steps
    same_weights(tmp_path / "unbroken", tmp_path / "run")


def val_task() -> redline.Task:
    gen = torch.Generator().manual_seed(1)
    val = TensorDataset(torch.randn(16, 4, generator=gen), torch.randint(0, 2, (16,), generator=gen))
    return dataclasses.replace(task(), val_data=val)


def test_a_run_resumed_past_the_steps_it_stopped_at_logs_the_evaluations_an_unbroken_run_does(tmp_path):
    # The stopped run's final evaluation at step 10 (mid-epoch: an epoch is 8 steps) stayed in eval.jsonl.
    trainer(tmp_path / "unbroken", val_task(), max_steps=20).fit()
    trainer(tmp_path / "run", val_task(), max_steps=10).fit()
    trainer(tmp_path / "run", val_task(), max_steps=20, resume="auto").fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    unbroken = [json.loads(line) for line in (tmp_path / "unbroken" / "eval.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [row["step"] for row in unbroken] == [8, 16, 20]


@pytest.mark.parametrize(
    ("pos", "kwargs", "evals"),
    [
        # 23 batches, 2 a step: step 11 ends at batch 22, and the epoch's evaluation comes after batch 23, at 11
        (Position(11, 0, 22), {"grad_accum": 2}, 10),
        (Position(11, 0, 22), {"grad_accum": 1}, 11),
        (Position(8, 0, 8), {"stopped": "signal SIGINT"}, 7),  # the stopped run's final evaluation, mid-epoch
        (Position(23, 1, 0), {"stopped": "early stopping"}, 23),  # the epoch's own, checkpointed after it
        (Position(10, 0, 10), {"stopped": "max_steps", "evaluates_each_epoch": False, "eval_every": 5}, 10),
        (Position(8, 0, 8), {"stopped": "max_steps", "evaluates_each_epoch": False, "eval_every": 5}, 7),
        # the run's last step, checkpointed before its final evaluation (due there): the resumed run owes it
        (Position(10, 0, 10), {"evaluates_again": True, "evaluates_each_epoch": False, "eval_every": 5}, 9),
    ],
)
def test_the_evaluation_log_keeps_the_rows_an_unbroken_run_has(pos, kwargs, evals):
    from redline.train.resume import log_cut

    kwargs = {"evaluates_each_epoch": True, **kwargs}
    assert log_cut(pos, 23, **kwargs) == (pos.step, evals)
