"""Models and optimizers off the tutorial's path: each trains, or is refused up front with the fix."""

from __future__ import annotations

import threading
from typing import NamedTuple

import pytest
import torch
import torch.nn.utils.prune
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline import Runtime
from redline.errors import ConfigError
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
    assert "the trial could not time fp32 (the model cannot be copied for a trial: TypeError:" in reason
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
