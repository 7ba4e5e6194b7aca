"""A job whose ranks disagree, or one of whose ranks stops, is told so in a line per cause, not torch's traceback."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.errors import TrainingError
from redline.train import evaluation
from redline.train.state import Run
from redline.train.trainer import Trainer

TASKS = Path(__file__).with_name("rank_tasks.py")
GLOO = (
    "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9402. GLHF!"
)


def train_two_ranks(task: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "redline", "train", "--task", f"{TASKS}:{task}", "--nproc", "2", "--devices", "cpu",
         "--no-progress", *args],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_ranks_given_models_of_other_shapes_are_refused_under_ddp_as_under_fsdp():
    """DDP's wrap compared the shapes first: 40 lines of torch's traceback ("params[0] in this process with sizes
    [8, 4] appears not to match"), exit 1."""
    result = train_two_ranks("width", "--max-steps", "2", "--strategy", "ddp")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "the ranks of this job were given different settings: model (structure and shapes) is" in result.stderr
    assert "Traceback" not in result.stderr and "appears not to match" not in result.stderr, result.stderr[-3000:]


def test_a_rank_left_in_the_evaluation_by_one_that_failed_says_another_stopped_first():
    """Rank 0 printed 60 lines of traceback ending in gloo's "Connection closed by peer ... GLHF!"."""
    result = train_two_ranks("eval_fails", "--max-steps", "4", "--eval-every", "2")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "rank 1 fails evaluating" in result.stderr  # rank 1's own error, then rank 0's:
    # met in val_data's first batch, checked after step 1, before the evaluation of step 2
    said = "val_data's first batch, after step 1: a collective with the other ranks failed"
    assert said in result.stderr, result.stderr[-3000:]
    assert "hint: another rank stopped first" in result.stderr
    assert "Traceback" not in result.stderr and "GLHF" not in result.stderr


def tiny_trainer(**kwargs) -> Trainer:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randint(0, 2, (32,), generator=gen))
    task = redline.Task(
        model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, val_data=data, batch_size=8
    )
    return Trainer(task, runtime=redline.RuntimeOptions(devices="cpu", seed=0), progress=False, **kwargs)


def broken(*args, **kwargs):
    raise RuntimeError(GLOO)


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("evaluation", "evaluation at step 2: a collective with the other ranks failed"),  # the sums' all-reduce
        # the same, first met in val_data's first batch, checked after step 1
        ("val_data's check", "val_data's first batch, after step 1: a collective with the other ranks failed"),
        ("log window", "after step 2: a collective with the other ranks failed"),  # the losses' all-reduce
    ],
)
def test_a_collective_broken_between_steps_says_another_rank_stopped_first(monkeypatch, where, said):
    if where == "evaluation":  # broken after the check's own sum
        real, calls = evaluation.all_reduce_sum, [0]

        def after_the_check(*args):
            calls[0] += 1
            return real(*args) if calls[0] == 1 else broken()

        monkeypatch.setattr(evaluation, "all_reduce_sum", after_the_check)
    elif where == "val_data's check":
        monkeypatch.setattr(evaluation, "all_reduce_sum", broken)
    else:
        monkeypatch.setattr(Run, "read_window", broken)
    with pytest.raises(TrainingError) as failed:
        tiny_trainer(max_steps=4, eval_every=2, log_every=2).fit()
    hint = "hint: another rank stopped first; its log says why (with --max-restarts K the job restarts from the last"
    assert str(failed.value) == f"{said}: Connection closed by peer [127.0.0.1]:9402\n{hint} checkpoint)"
