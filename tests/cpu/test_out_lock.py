"""Two runs on one out_dir: the second is refused at once, and a lock a killed run left blocks nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.errors import ConfigError
from redline.train.callbacks import Callback
from redline.train.lock import LOCK
from redline.train.trainer import Trainer

# Holds out_dir's lock as a run does, forks a child that outlives it (a DataLoader worker, say), says so with the
# child's pid once the child runs, and waits until the test kills it. The child closes its copy of the lock's
# descriptor as it starts (redline.train.lock): one not yet scheduled when the test locks again, on a loaded
# machine, would still hold the lock.
HOLDER = """
import multiprocessing, sys, time
from pathlib import Path
from redline.train.lock import holding_out_dir

def outlive(started):
    started.set()
    time.sleep(120)

with holding_out_dir(Path(sys.argv[1])):
    fork = multiprocessing.get_context("fork")
    started = fork.Event()
    child = fork.Process(target=outlive, args=(started,), daemon=False)
    child.start()
    started.wait()
    print("held", child.pid, flush=True)
    sys.stdin.read()
"""


def task() -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randint(0, 2, (32,), generator=gen))
    return redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8, epochs=1)  # fmt: skip


def trainer(out: Path, **fields: Any) -> Trainer:
    return Trainer(task(), runtime=redline.RuntimeOptions(devices="cpu"), out_dir=out, progress=False, **fields)


@contextlib.contextmanager
def held_by_another_process(out: Path) -> Iterator[subprocess.Popen]:
    """Run HOLDER on ``out`` until it holds the lock; kill it, and the child it forked, on the way out."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child = None
    try:
        assert holder.stdout is not None
        said, child = holder.stdout.readline().split()
        assert said == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), signal.SIGKILL)


def test_a_second_run_on_an_out_dir_in_use_is_refused_at_once_and_a_killed_runs_lock_blocks_nothing(tmp_path):
    """Before, both runs wrote checkpoints and logs into one directory, pruning and cleaning up each other's."""
    with held_by_another_process(tmp_path) as holder:
        with pytest.raises(ConfigError) as raised:
            trainer(tmp_path, max_steps=2).fit()
        assert sorted(path.name for path in tmp_path.iterdir()) == [LOCK]  # the refused run wrote nothing
        holder.kill()  # SIGKILL: it lets go of nothing itself, and its pid stays written in the lock file
        holder.wait()
        assert trainer(tmp_path, max_steps=2).fit().steps == 2  # the kernel let go, though its child lives on
    assert str(raised.value) == (
        f"out_dir={str(tmp_path)!r} is not allowed; expected a directory no other run is writing in; another run "
        f"(pid {holder.pid}) is writing its checkpoints and logs there now\nhint: wait for that run to end "
        "(resume='auto' then continues it), or pass another out_dir=DIR"
    )
    assert (tmp_path / "summary.json").is_file()


def test_redline_train_names_the_out_dir_in_use_by_its_flag(tmp_path, redline_here):
    command = ["train", "--task", "example:digits", "--max-steps", "1"]
    with held_by_another_process(tmp_path) as holder:
        result = redline_here(*command, "--out", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert result.stderr.endswith(
        f"error: --out={str(tmp_path)!r} is not allowed; expected a directory no other run is writing in; another "
        f"run (pid {holder.pid}) is writing its checkpoints and logs there now\nhint: wait for that run to end "
        "(--resume 'auto' then continues it), or pass another --out DIR\n"
    )


def test_redline_train_with_nproc_refuses_an_out_dir_in_use_before_starting_a_worker(tmp_path, redline_here):
    """Before, each worker started, loaded the task and was refused, and was restarted to be refused again."""
    command = ["train", "--task", "example:digits", "--max-steps", "1"]
    command += ["--nproc", "1", "--max-restarts", "3", "--out", str(tmp_path)]
    with held_by_another_process(tmp_path) as holder:
        result = redline_here(*command)
    assert result.returncode == 2, result.stderr
    assert result.stderr.endswith(
        f"another run (pid {holder.pid}) is writing its checkpoints and logs there now\nhint: wait for that run to "
        "end (--resume 'auto' then continues it), or pass another --out DIR\n"
    )
    assert "attempt" not in result.stderr and "rank 0" not in result.stderr  # said by the launcher, no worker ran


class StartAnother(Callback):
    """Start a second run in the first one's out_dir at its first step, and keep what that raised."""

    def __init__(self, out: Path) -> None:
        self.out, self.refused = out, None

    def on_step(self, trainer: Trainer, step: int, loss: float) -> None:
        if self.refused is None:
            with pytest.raises(ConfigError) as raised:
                Trainer(task(), runtime=redline.RuntimeOptions(devices="cpu"), out_dir=self.out, progress=False).fit()
            self.refused = raised.value


class Fail(Callback):
    def on_step(self, trainer: Trainer, step: int, loss: float) -> None:
        raise RuntimeError("a callback that fails")


def test_the_lock_is_held_for_the_fit_alone_and_let_go_when_it_fails(tmp_path):
    another = StartAnother(tmp_path)
    summary = Trainer(task(), runtime=redline.RuntimeOptions(devices="cpu"), out_dir=tmp_path, progress=False,
                      log_every=1, max_steps=2, callbacks=[another]).fit()  # fmt: skip
    assert summary.steps == 2 and "no other run is writing in" in str(another.refused)  # even in one process
    assert (tmp_path / LOCK).read_text() == ""  # no run holds it
    with pytest.raises(RuntimeError, match="a callback that fails"):
        trainer(tmp_path, log_every=1, max_steps=4, resume="auto", callbacks=[Fail()]).fit()
    assert trainer(tmp_path, max_steps=4, resume="auto").fit().steps == 4  # the failed run let go of it


def test_no_out_dir_takes_no_lock(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Trainer(task(), runtime=redline.RuntimeOptions(devices="cpu"), progress=False, max_steps=1).fit().steps == 1
    assert list(tmp_path.iterdir()) == []
