"""SIGINT or SIGTERM during an evaluation stops the run after it, with a checkpoint of its steps: it trained one more
step before, with nothing said, and a second Ctrl-C meanwhile lost every step since the last checkpoint."""

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.train.trainer import Trainer

TASKS = Path(__file__).with_name("rank_tasks.py")


def signalling_task(at_call: int) -> redline.Task:
    """A task whose metric sends this process SIGINT at its ``at_call``-th call (0: never). The first call is
    val_data's first batch, checked after step 1; each evaluation is 2 batches of 8."""
    calls = [0]

    def metric(outputs: torch.Tensor, targets: torch.Tensor) -> float:
        calls[0] += 1
        if calls[0] == at_call:
            signal.raise_signal(signal.SIGINT)
        return float((outputs.argmax(-1) == targets).float().mean())

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 4, generator=gen), torch.randint(0, 2, (48,), generator=gen))
    return redline.Task(
        model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), loss_fn=nn.functional.cross_entropy,
        train_data=data, val_data=TensorDataset(*data[:16]), batch_size=8, metric=metric,
    )  # fmt: skip


def fit(made: redline.Task, out, **kwargs) -> redline.TrainSummary:
    config = {"log_every": 1, "out_dir": out, "trial": "off", **kwargs}
    runtime = redline.RuntimeOptions(devices="cpu", seed=0)
    with Trainer(made, runtime=runtime, progress=False, **config) as trainer:
        return trainer.fit()


@pytest.mark.parametrize(
    ("when", "stops_at", "evaluated"),
    [
        ({"eval_every": 2, "max_steps": 6}, 2, [2, 4, 6]),  # every 2 steps: SIGINT in step 2's evaluation
        ({"eval_every": None, "max_steps": 12}, 6, [6, 12]),  # at each epoch's end (6 steps): in epoch 1's
        # a checkpoint due at the epoch's last step is written before its evaluation: written again, holding it
        ({"eval_every": None, "max_steps": 12, "checkpoint_every": 6}, 6, [6, 12]),
    ],
)
def test_a_ctrl_c_during_an_evaluation_stops_the_run_after_it_and_the_resume_ends_as_an_unbroken_run(
    tmp_path, caplog, when, stops_at, evaluated
):
    unbroken = fit(signalling_task(0), tmp_path / "unbroken", **when)
    with caplog.at_level(logging.WARNING, logger="redline"):
        stopped = fit(signalling_task(2), tmp_path / "run", **when)
    assert (stopped.steps, stopped.stopped) == (stops_at, "signal SIGINT"), "not after the next step"
    assert "SIGINT: stopping after this evaluation, then writing a checkpoint" in caplog.text
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [f"step-{stops_at:08d}"]
    kept = torch.load(tmp_path / "run" / "checkpoints" / f"step-{stops_at:08d}" / "extra.pt", weights_only=False)
    assert (kept["stopped"], kept["evaluated"]) == ("signal SIGINT", True), "the resume need not evaluate it again"
    resumed = fit(signalling_task(0), tmp_path / "run", resume="auto", **when)
    assert resumed.steps == when["max_steps"] and resumed.val_loss == unbroken.val_loss
    a, b = load_file(tmp_path / "unbroken" / "model.safetensors"), load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line)["step"] for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert rows == evaluated, "the stopped evaluation logged once"


def test_a_signal_one_rank_gets_during_an_evaluation_stops_every_rank_after_it(tmp_path):
    out = tmp_path / "run"
    ran = subprocess.run(
        [sys.executable, "-m", "redline", "train", "--task", f"{TASKS}:eval_signal", "--nproc", "2", "--devices", "cpu",
         "--no-progress", "--max-steps", "8", "--eval-every", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=180, env={**os.environ, "REDLINE_TRACEBACK": "1"},
    )  # fmt: skip
    assert ran.returncode == 128 + signal.SIGTERM, ran.stderr[-3000:]  # a signal sent to a worker, as said
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["stopped"]) == (2, "signal (agreed by all ranks)"), ran.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]
