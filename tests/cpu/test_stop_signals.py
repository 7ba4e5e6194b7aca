"""Commands stopped by SIGTERM or Ctrl-C while they load or run: one line saying what was left."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

SIGNALS = [(signal.SIGTERM, "SIGTERM", 143), (signal.SIGINT, "Ctrl-C", 130), (signal.SIGHUP, "SIGHUP", 129)]

SLOW_FACTORY = """
import pathlib
import time

from torch import nn
from redline.serve.servable import Servable


def make():
    pathlib.Path({started!r}).touch()
    time.sleep(60)  # a large model loading
    return Servable(model=nn.Identity(), input_shape=(3,), name="slow")
"""

SLOW_MODEL = """
import pathlib
import time

from torch import nn
from redline.serve.servable import Servable


class Slow(nn.Module):
    def forward(self, x):
        if bool((x != 0).any()):  # a row of the input, not the warm-up's zeros
            pathlib.Path({started!r}).touch()
            time.sleep(0.1)
        return x * 2


def make():
    return Servable(model=Slow(), input_shape=(3,), name="slow")
"""


SLOW_TASK = """
import pathlib
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        pathlib.Path({started!r}).touch()
        time.sleep(0.1)
        return self.linear(x)


def make(slow_load: bool = True):
    if slow_load:
        pathlib.Path({started!r}).touch()
        time.sleep(60)  # a dataset read for minutes
    data = TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,)))
    return redline.Task(model=Slow, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8)
"""


def signalled(tmp_path, source: str, argv: list[str], signum: int) -> subprocess.CompletedProcess:
    """Run `redline ARGV` with the factory ``slow.py:make`` written from ``source`` (given where ARGV says
    ``{spec}``, else after the command); signal it once it touched ``tmp_path/started``, and return how it ended."""
    started = tmp_path / "started"
    (tmp_path / "slow.py").write_text(source.format(started=str(started)))
    spec = f"{tmp_path / 'slow.py'}:make"
    argv = [arg.format(spec=spec) for arg in argv] if "{spec}" in argv else [argv[0], spec, *argv[1:]]
    run = subprocess.Popen(
        [sys.executable, "-m", "redline", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal, not a background job
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not started.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), "the model never ran"
    run.send_signal(signum)
    out, err = run.communicate(timeout=30)  # not the 60 s the slow factory sleeps
    return subprocess.CompletedProcess(run.args, run.returncode, out, err)


COMMANDS = [
    (["serve", "--port", "0"], "nothing was served"),
    (["predict", "--input", "{x}", "--output", "{y}"], "--output was not written (a file there is kept)"),
]


@pytest.mark.parametrize(("signum", "said", "code"), SIGNALS)
@pytest.mark.parametrize(("command", "outcome"), COMMANDS)
def test_a_signal_while_the_model_loads_says_what_was_left(tmp_path, signum, said, code, command, outcome):
    np.save(tmp_path / "x.npy", np.ones((4, 3), np.float32))
    argv = [arg.format(x=tmp_path / "x.npy", y=tmp_path / "y.npy") for arg in command]
    ended = signalled(tmp_path, SLOW_FACTORY, argv, signum)
    assert ended.returncode == code, ended.stderr
    assert f"error: stopped by {said} while loading the model: {outcome}" in ended.stderr, ended.stderr
    assert "Traceback" not in ended.stderr and "listening" not in ended.stdout and not (tmp_path / "y.npy").exists()


@pytest.mark.parametrize(("signum", "said", "code"), SIGNALS)
def test_a_signal_while_predicting_leaves_the_older_output_and_no_temporary_file(tmp_path, signum, said, code):
    out = tmp_path / "out"
    out.mkdir()
    np.save(out / "y.npy", np.arange(3.0))  # an older result: predict replaces only an earlier array
    older = (out / "y.npy").read_bytes()
    np.save(tmp_path / "x.npy", np.ones((400, 3), np.float32))
    argv = ["predict", "--input", str(tmp_path / "x.npy"), "--output", str(out / "y.npy"), "--batch-size", "4",
            "--measure", "off", "--compile", "off"]  # fmt: skip
    ended = signalled(tmp_path, SLOW_MODEL, argv, signum)
    assert ended.returncode == code, ended.stderr
    assert f"error: stopped by {said} while predicting: --output was not written" in ended.stderr
    assert "Traceback" not in ended.stderr
    assert sorted(p.name for p in out.iterdir()) == ["y.npy"], "the temporary file of the outputs was left"
    assert (out / "y.npy").read_bytes() == older


@pytest.mark.parametrize("command", ["train", "memory", "bench", "tune", "profile"])
def test_a_signal_while_the_task_loads_says_so(tmp_path, command):
    """Before, each ended with a bare 130, or killed by SIGTERM without a word."""
    signum, said, code = SIGNALS[command == "train"]  # SIGTERM for most, Ctrl-C for one
    ended = signalled(tmp_path, SLOW_TASK, [command, "--task", "{spec}"], signum)
    assert ended.returncode == code, ended.stderr
    assert f"error: stopped by {said} while loading the task: nothing had run yet" in ended.stderr, ended.stderr
    assert "Traceback" not in ended.stderr


def test_ctrl_c_while_profiling_says_so(tmp_path):
    """Before, a bare 130, or now and then an AssertionError of the profiler's, blamed on the task."""
    argv = ["profile", "--task", "{spec}", "--task-arg", "slow_load=false", "--steps", "1000", "--compile", "off"]
    ended = signalled(tmp_path, SLOW_TASK, argv, signal.SIGINT)
    assert ended.returncode == 130, ended.stderr
    assert "error: stopped by Ctrl-C while profiling: nothing was written" in ended.stderr, ended.stderr
    assert "Traceback" not in ended.stderr
