"""The trial's cache from a user's side: `--trial fresh` measures again in place of a cached choice, and one
workload finds one entry however its batch size was given."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.hardware.device import probe_device
from redline.parallel.env import DistEnv
from redline.runtime import measure
from redline.runtime.measure import measure_auto
from redline.runtime.options import RuntimeOptions
from redline.runtime.trial import Measured
from redline.runtime.tuned import Candidate, Trial, TunedPlan, store_tuned
from redline.runtime.tuned_run import find_tuned
from redline.task import Task
from redline.train.trainer import Trainer

TASK_FILE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline

def make(batch_size: int = 16):
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 1, generator=gen))
    return redline.Task(model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)),
                        loss_fn=nn.functional.mse_loss, train_data=data, batch_size=batch_size, name="tiny")
"""


def tiny_task(batch_size: int = 16) -> Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 1, generator=gen))
    model = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))  # noqa: E731
    return Task(model=model, loss_fn=nn.functional.mse_loss, train_data=data, batch_size=batch_size, name="tiny")


def timed(precision: str, step_ms: float) -> Measured:
    return Measured(precision, tuple([step_ms / 1e3] * 12), (2.0, 1.8))


@pytest.fixture
def trials(tmp_path, monkeypatch):
    """Plan as on an AMX CPU and count the trials: the first times bf16 at 0.7 of fp32's step (a lucky moment on a
    busy machine), every later one at 3x."""
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("REDLINE_CPU", "amx")
    calls = []

    def fake_trial(model, optimizer, loss_fn, batch, device, candidates, **_):
        calls.append(candidates)
        return [timed("fp32", 10.0), timed("bf16-mixed", 7.0 if len(calls) == 1 else 30.0)]

    monkeypatch.setattr(measure, "run_trial", fake_trial)
    return calls


def precision_of(**config) -> tuple[str, str]:
    with Trainer(tiny_task(), max_steps=1, progress=False, **config) as trainer:
        chosen = trainer.fit().plan.precision
    return chosen.value, chosen.reason


def test_trial_fresh_measures_again_and_its_choice_replaces_the_cached_one(trials):
    """`--trial on` read the cache first: a trial measured on a busy machine stayed pinned, with no way to
    measure again but deleting folders."""
    assert precision_of(trial="on")[0] == "bf16-mixed"
    value, reason = precision_of(trial="on")
    assert value == "bf16-mixed" and "cached from" in reason and len(trials) == 1
    value, reason = precision_of(trial="fresh")
    assert value == "fp32" and reason.startswith("measured: fp32 kept") and "cached" not in reason
    assert len(trials) == 2
    value, reason = precision_of(trial="auto")  # a run too short to repay a trial reads the fresh one
    assert value == "fp32" and "cached from" in reason and len(trials) == 2


def test_redline_train_takes_trial_fresh(trials, tmp_path, redline_here):
    (tmp_path / "tiny.py").write_text(TASK_FILE)
    spec = f"{tmp_path / 'tiny.py'}:make"

    def train(trial: str) -> dict[str, object]:
        ran = redline_here("train", "--task", spec, "--max-steps", "1", "--trial", trial, "--json", "--no-progress")
        assert ran.returncode == 0, ran.stderr
        return json.loads(ran.stdout)["plan"]["precision"]

    assert train("on")["value"] == "bf16-mixed"
    fresh = train("fresh")
    assert fresh["value"] == "fp32" and "cached" not in fresh["reason"] and len(trials) == 2
    assert "cached from" in train("on")["reason"] and len(trials) == 2
    refused = redline_here("train", "--task", spec, "--trial", "again")
    assert refused.returncode == 2 and "'auto', 'on', 'off', 'fresh'" in refused.stderr


def test_one_workload_finds_one_cached_trial_however_its_batch_size_is_given(trials):
    """`--batch-size 32` (the run's batch) and `--task-arg batch_size=32` (the Task's own) made two entries."""
    cpu, env = RuntimeOptions(devices="cpu"), DistEnv()
    given_to_the_run = measure_auto(tiny_task(batch_size=16), cpu, 32, 5000, env, trial="auto")["precision"]
    given_to_the_task = measure_auto(tiny_task(batch_size=32), cpu, 32, 5000, env, trial="auto")["precision"]
    assert given_to_the_run.value == given_to_the_task.value == "bf16-mixed"
    assert "cached from" in given_to_the_task.reason and len(trials) == 1
    measure_auto(tiny_task(batch_size=32), cpu, 16, 5000, env, trial="auto")  # another batch is another workload
    assert len(trials) == 2


def test_a_tune_at_a_batch_size_is_found_by_a_run_whose_task_was_given_that_batch_size(tmp_path, monkeypatch):
    """`redline tune --batch-size 32` cached its Plan where `redline train --task-arg batch_size=32` did not look."""
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    tuned = TunedPlan(
        task="tiny", device="cpu", batch_size=32, planned_steps=500, measured_at="2026-12-01 06:00 UTC",
        best=Candidate(compile_mode="default"), reasons={}, trials=(Trial(Candidate(), 0.002),),
    )  # fmt: skip
    store_tuned(tiny_task(batch_size=16).fingerprint(), probe_device(torch.device("cpu")), tuned)
    found = find_tuned(tiny_task(batch_size=32), RuntimeOptions(devices="cpu"), 32, DistEnv())
    assert found is not None and "tuned 2026-12-01 06:00 UTC" in found.tuning.note


def test_auto_times_no_mixed_precision_for_a_half_model_and_keeps_fp32(trials):
    """The trial timed bf16-mixed on a .half() model, chose it, and the run was refused at setup (cached: every run)."""
    task = tiny_task()
    half = task.model
    task = Task(model=lambda: half().half(), loss_fn=lambda out, y: nn.functional.mse_loss(out.float(), y),
                train_data=task.train_data, batch_size=16, name="tiny half")  # fmt: skip
    task.train_data.tensors = tuple(t.half() for t in task.train_data.tensors)
    with Trainer(task, max_steps=1, progress=False, trial="on") as trainer:
        chosen = trainer.fit().plan.precision
    assert chosen.value == "fp32" and chosen.reason.startswith("auto: fp32, not bf16-mixed, since the model trains ")
    assert trials == []  # nothing was timed
