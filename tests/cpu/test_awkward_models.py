"""Models and optimizers off the tutorial's path: each trains, or is refused up front with the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline import Runtime
from redline.errors import ConfigError
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
