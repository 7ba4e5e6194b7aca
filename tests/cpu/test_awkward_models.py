"""Models and optimizers off the tutorial's path: each trains, or is refused up front with the fix."""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import pytest
import torch
import torch.nn.utils.prune
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline import Runtime
from redline.errors import ConfigError, TrainingError
from redline.parallel.env import DistEnv
from redline.runtime.measure import measure_auto
from redline.runtime.options import RuntimeOptions
from redline.runtime.trial import run_trial
from redline.train.trainer import Trainer

GEN = torch.Generator().manual_seed(0)
X, Y = torch.randn(32, 4, generator=GEN), torch.randn(32, 1, generator=GEN)


def regression(**changes) -> redline.Task:
    fields = {
        "model": lambda: nn.Linear(4, 1),
        "loss_fn": nn.functional.mse_loss,
        "train_data": TensorDataset(X, Y),
        "batch_size": 8,
    }
    return redline.Task(**{**fields, **changes})


@pytest.fixture
def trial_runs(monkeypatch, tmp_path):
    """Plan as on an AMX CPU, where auto measures bf16 against fp32 on copies of the model before the run."""
    monkeypatch.setenv("REDLINE_CPU", "amx")
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "cache"))


LBFGS = r"(?s)LBFGS\.step\(\) needs a closure.*hint: use an optimizer that steps without a closure"


def test_an_optimizer_that_needs_a_closure_is_refused_by_the_runtime_with_the_fix():
    with Runtime(devices="cpu") as rt, pytest.raises(ConfigError, match=LBFGS):
        rt.setup(nn.Linear(4, 1), lambda params: torch.optim.LBFGS(params))


def test_an_optimizer_that_needs_a_closure_is_refused_before_the_trial_or_the_first_step(trial_runs):
    task = regression(optimizer=lambda params: torch.optim.LBFGS(params, lr=0.1))
    for trial in ("on", "off"):
        with pytest.raises(ConfigError, match=LBFGS), Trainer(task, max_steps=2, trial=trial, progress=False) as t:
            t.fit()


class Pruned(nn.Module):
    """A layer pruned by torch.nn.utils.prune: a forward pre-hook derives its weight (weight_orig * weight_mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        torch.nn.utils.prune.l1_unstructured(self.fc, "weight", amount=0.5)

    def forward(self, x):
        return self.fc(x)


class Locked(nn.Linear):
    """A model holding what no copy can take (a lock)."""

    def __init__(self) -> None:
        super().__init__(4, 1)
        self.lock = threading.Lock()


def test_a_pruned_model_is_measured_on_copies_and_left_as_it_was():
    model = Pruned()
    model(X[:2])  # a forward leaves the derived weight on the module, as a tensor deepcopy refuses
    before = {k: v.clone() for k, v in model.state_dict().items()}
    results = run_trial(
        model, lambda p: torch.optim.SGD(p, lr=0.1), nn.functional.mse_loss, (X[:8], Y[:8]), torch.device("cpu"),
        ["bf16-mixed"],
    )  # fmt: skip
    assert [m.precision for m in results] == ["fp32", "bf16-mixed"] and results[0].step_times
    assert not results[0].rejected
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_pruned_model_trains_after_its_trial(trial_runs):
    with Trainer(regression(model=Pruned), max_steps=3, trial="on", progress=False) as trainer:
        summary = trainer.fit()
    assert summary.plan.precision.reason.startswith("measured:") and summary.steps == 3


def test_a_model_that_cannot_be_copied_skips_the_trial_and_says_why_in_the_plan(trial_runs):
    with Trainer(regression(model=Locked), max_steps=3, trial="on", progress=False) as trainer:
        summary = trainer.fit()
    reason = summary.plan.precision.reason
    assert "the trial could not measure fp32 (the model cannot be copied for a trial: TypeError:" in reason
    assert summary.plan.precision.value == "fp32" and summary.steps == 3


class Heads(NamedTuple):
    value: torch.Tensor
    label: torch.Tensor


class TwoHeads(nn.Module):
    """A model that returns several outputs: a dict (``as_dict``) or a namedtuple of a regression and its class."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.fc, self.as_dict = nn.Linear(4, 1), as_dict

    def forward(self, x):
        value = self.fc(x)
        label = (value > 0).long().squeeze(1)
        return {"value": value, "label": label} if self.as_dict else Heads(value, label)


@pytest.mark.parametrize("as_dict", [True, False])
def test_a_model_with_several_outputs_trains_evaluates_and_predicts_them_all(as_dict):
    def loss_fn(outputs, targets):
        return nn.functional.mse_loss(outputs["value"] if as_dict else outputs.value, targets)

    task = regression(model=lambda: TwoHeads(as_dict), loss_fn=loss_fn, val_data=TensorDataset(X, Y))
    with Trainer(task, max_steps=3, progress=False) as trainer:
        summary = trainer.fit()
        predicted = trainer.predict(TensorDataset(X[:13]), batch_size=5)  # three batches, the last partial
        model = trainer.rt.module
    assert summary.steps == 3 and summary.val_loss is not None
    value, label = (predicted["value"], predicted["label"]) if as_dict else predicted
    assert isinstance(predicted, dict if as_dict else Heads)
    with torch.no_grad():
        assert torch.allclose(value, model.fc(X[:13])) and value.dtype == torch.float32
    assert label.shape == (13,) and label.dtype == torch.int64  # class ids keep their dtype


def plateau_task(**changes) -> redline.Task:
    """Steps too small to move the validation loss: every evaluation after the first is a plateau."""
    fields = {
        "optimizer": lambda params: torch.optim.SGD(params, lr=1e-9),
        "scheduler": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, eps=0),
        "val_data": TensorDataset(X, Y),
    }
    return regression(**{**fields, **changes})


def test_reduce_lr_on_plateau_steps_on_the_validation_loss_after_each_evaluation_and_resumes(tmp_path):
    with Trainer(plateau_task(), max_steps=6, eval_every=2, progress=False) as trainer:
        trainer.fit()  # evaluations at steps 2, 4 and 6: the first sets the best, the two after it halve the lr
        assert trainer.rt.optimizer.param_groups[0]["lr"] == pytest.approx(1e-9 / 4)
    out = {"out_dir": tmp_path, "checkpoint_every": 2, "eval_every": 2, "progress": False}
    with Trainer(plateau_task(), max_steps=4, **out) as trainer:
        trainer.fit()
    with Trainer(plateau_task(), max_steps=6, resume="auto", **out) as trainer:
        trainer.fit()  # the scheduler's state came back with the checkpoint: one more halving, not a fresh start
        assert trainer.rt.optimizer.param_groups[0]["lr"] == pytest.approx(1e-9 / 4)


def test_reduce_lr_on_plateau_in_max_mode_steps_on_the_tasks_metric():
    max_mode = lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0, eps=0)  # noqa: E731
    with Trainer(plateau_task(scheduler=max_mode, metric=lambda o, t: 0.5), max_steps=4, eval_every=2,
                 progress=False) as trainer:  # fmt: skip
        trainer.fit()
        assert trainer.rt.optimizer.param_groups[0]["lr"] == pytest.approx(1e-9 / 2)
    with pytest.raises(ConfigError, match=r"(?s)mode='max'\) steps on a metric.*the task has no metric"):
        Trainer(plateau_task(scheduler=max_mode), max_steps=2, progress=False).fit()


class NeedsLoss:
    """A scheduler of the user's own, stepped on the training loss."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, loss: float) -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"val_data": None}, r"ReduceLROnPlateau steps on a metric, .* no val_data"),
        ({"scheduler": lambda opt: NeedsLoss(opt)}, r"NeedsLoss\.step\(\) needs loss, which the Trainer does not know"),
        ({"scheduler": lambda opt: None}, r"scheduler\(optimizer\)='NoneType' is not allowed; expected an LR"),
    ],
)
def test_a_scheduler_the_loop_cannot_step_is_refused_before_training(changes, message):
    with pytest.raises(ConfigError, match=f"(?s){message}.*hint: "), Trainer(plateau_task(**changes), max_steps=2,
                                                                             progress=False) as trainer:  # fmt: skip
        trainer.fit()


def test_an_optimizer_factory_that_ignores_its_params_is_refused_rather_than_training_nothing():
    """`lambda params: AdamW(net.parameters())` with a net of its own: the run's model never moved, silently."""
    elsewhere = nn.Linear(4, 1)
    task = regression(optimizer=lambda params: torch.optim.AdamW(elsewhere.parameters(), lr=1e-2))
    message = r"(?s)the optimizer factory built an optimizer over parameters that are not the model's.*hint: build it"
    with pytest.raises(ConfigError, match=message), Trainer(task, max_steps=2, progress=False) as trainer:
        trainer.fit()


def test_a_trial_whose_fp32_loss_diverges_decides_nothing_and_caches_nothing(trial_runs):
    """fp32 NaN (a learning rate too high) made every candidate 'non-finite'; that verdict was cached under the
    model's fingerprint, so the same model with the rate fixed never ran bf16 again, for a reason no longer true."""
    options, env = RuntimeOptions(devices="cpu"), DistEnv()
    diverging = regression(loss_fn=lambda outputs, targets: nn.functional.mse_loss(outputs, targets) * math.nan)
    found = measure_auto(diverging, options, 8, 1000, env, trial="on")["precision"]
    assert found.value == "fp32" and "the trial could not measure fp32 (its own loss was nan" in found.reason
    fixed = measure_auto(regression(), options, 8, 1000, env, trial="on")["precision"]
    assert fixed.reason.startswith("measured:") and "cached" not in fixed.reason
    assert "non-finite" not in fixed.reason


def test_a_lazy_model_is_refused_at_setup_with_the_fix_and_runs_once_initialized():
    """An nn.LazyLinear crashed inside setup on the uninitialized parameter's numel(), naming no layer."""
    lazy = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 1))
    message = r"(?s)parameters 0\.weight, 0\.bias are not initialized yet.*hint: run one forward on a sample batch"
    with Runtime(devices="cpu") as rt, pytest.raises(ConfigError, match=message):
        rt.setup(lazy, lambda params: torch.optim.SGD(params, lr=0.1))
    lazy(X[:2])  # the fix the hint names
    with Runtime(devices="cpu") as rt:
        model, optimizer = rt.setup(lazy, lambda params: torch.optim.SGD(params, lr=0.1))
        rt.backward(nn.functional.mse_loss(model(X[:8]), Y[:8]))
        assert rt.step(optimizer)


def test_a_schedule_shorter_than_the_run_stops_it_with_the_step_and_the_fix():
    """OneCycleLR sized for 3 steps in a run of 5 (a resumed run made longer, say) raised torch's bare ValueError."""
    task = regression(scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=3))
    message = (
        r"(?s)step 4: the LR scheduler \(OneCycleLR\) raised ValueError: Tried to step 4 times.*"
        r"hint: a schedule sized in steps \(OneCycleLR's total_steps, say\) must cover the whole run"
    )
    with pytest.raises(TrainingError, match=message), Trainer(task, max_steps=5, progress=False) as trainer:
        trainer.fit()
