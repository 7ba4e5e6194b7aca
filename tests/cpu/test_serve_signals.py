"""`redline serve` and `redline predict` stopped by SIGTERM or Ctrl-C while their model loads: one line saying so."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

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


SIGNALS = [(signal.SIGTERM, "SIGTERM", 143), (signal.SIGINT, "Ctrl-C", 130)]
COMMANDS = [
    (["serve", "--port", "0"], "nothing was served"),
    (["predict", "--input", "{x}", "--output", "{y}"], "--output was not written (a file there is kept)"),
]


@pytest.mark.parametrize(("signum", "said", "code"), SIGNALS)
@pytest.mark.parametrize(("command", "outcome"), COMMANDS)
def test_a_signal_while_the_model_loads_says_what_was_left(tmp_path, signum, said, code, command, outcome):
    started = tmp_path / "started"
    (tmp_path / "slow.py").write_text(SLOW_FACTORY.format(started=str(started)))
    np.save(tmp_path / "x.npy", np.ones((4, 3), np.float32))
    args = [arg.format(x=tmp_path / "x.npy", y=tmp_path / "y.npy") for arg in command]
    run = subprocess.Popen(
        [sys.executable, "-m", "redline", args[0], f"{tmp_path / 'slow.py'}:make", *args[1:]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal, not a background job
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not started.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), "the model never began loading"
    run.send_signal(signum)
    out, err = run.communicate(timeout=30)  # not the 60 s the factory sleeps
    assert run.returncode == code, err
    assert f"error: stopped by {said} while loading the model: {outcome}" in err, err
    assert "Traceback" not in err and "listening" not in out and not (tmp_path / "y.npy").exists()
