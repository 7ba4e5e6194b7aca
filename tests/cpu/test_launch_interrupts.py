"""A second Ctrl-C under the launcher aborts the job at once, as it aborts a run in one process.

It became SIGTERM to the workers (torchrun's agent, interrupted as it waited for them, stopped them again with
its default signal), which carried on stopping: a checkpoint, the final evaluation, summary.json and the weights.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from redline.launch.interrupts import Interrupts
from redline.parallel.env import FINISHING

TASK = Path(__file__).with_name("slow_task.py")
# A worker as torchrun starts one (a session of its own), saying each SIGINT it gets
WORKER = """import itertools, signal
count = itertools.count(1)
signal.signal(signal.SIGINT, lambda signum, frame: print("SIGINT", next(count), flush=True))
print("ready", flush=True)
while True:
    signal.pause()
"""


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers in /proc")
def test_torchruns_handler_stops_on_the_first_signal_and_each_later_sigint_goes_to_the_workers(tmp_path):
    """Copies of the first SIGINT within SAME_CTRL_C_S are that one; a later SIGINT is a second."""
    from torch.distributed.elastic.multiprocessing import api

    torchruns = api._terminate_process_handler
    now = [100.0]
    interrupts = Interrupts(tmp_path / "finished", clock=lambda: now[0])
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert worker.stdout.readline() == "ready\n"
        with interrupts.passing_on():
            handle = api._terminate_process_handler  # what torchrun installs as it starts its workers
            with pytest.raises(api.SignalException):  # the first: torchrun's agent sends it on and waits
                handle(signal.SIGINT, None)
            assert interrupts.aborted is None and not (tmp_path / "finished.interrupted").exists()
            now[0] += 0.01
            handle(signal.SIGINT, None)  # the first again (`timeout` passes the terminal's on): no second
            assert interrupts.aborted is None and not (tmp_path / "finished.interrupted").exists()
            now[0] += 1.0
            handle(signal.SIGINT, None)  # the second: to the workers, and the agent's wait goes on
            assert worker.stdout.readline() == "SIGINT 1\n"
            assert interrupts.aborted == "stopping" and (tmp_path / "finished.interrupted").exists()
            (tmp_path / "finished.interrupted").write_text(FINISHING)  # as a worker past its last step writes
            assert interrupts.aborted == "finishing"
            with pytest.raises(api.SignalException):  # any other signal is torchrun's, as before
                handle(signal.SIGTERM, None)
        assert api._terminate_process_handler is torchruns
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers in /proc")
def test_a_launcher_started_ignoring_ctrl_c_leaves_it_ignored_once_its_workers_start(tmp_path):
    """A script's background job (`redline launch ... &`) ignores SIGINT; torchrun's handler would take it over."""
    from torch.distributed.elastic.multiprocessing import api

    interrupts = Interrupts(tmp_path / "finished")
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts.passing_on():
            handle = api._terminate_process_handler
            handle(signal.SIGINT, None)  # ignored: no stop, nothing counted
            assert not interrupts.stopping and interrupts.count == 0
            with pytest.raises(api.SignalException):  # SIGTERM, not ignored, stops the workers as before
                handle(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.slow
def test_a_second_ctrl_c_to_a_launched_run_aborts_it_at_once_with_exit_130(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "redline", "train", "--task", f"{TASK}:task", "--nproc", "2", "--max-steps", "50",
               "--out", str(out), "--checkpoint-every", "1", "--trial", "off", "--no-progress"]  # fmt: skip
    # a session of its own, signalled as a terminal signals its foreground job: the whole group
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        assert wait_for(lambda: (out / "checkpoints" / "step-00000002").is_dir(), 120), "".join(said)[-3000:]
        os.killpg(proc.pid, signal.SIGINT)  # in step 3, of 1 s
        assert wait_for(lambda: "stopping after this step" in "".join(said), 60), "".join(said)[-3000:]
        os.killpg(proc.pid, signal.SIGINT)  # as the run stops: its final evaluation takes 60 s
        sent = time.monotonic()
        proc.wait(timeout=20)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=5)
    stderr = "".join(said)
    assert proc.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert took < 15, f"{took:.1f} s after the second Ctrl-C"
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    step = int(newest.name.removeprefix("step-"))
    aborted = "error: aborted by a second SIGINT while the run was stopping; its last checkpoint is"
    assert stderr.count("aborted by a second SIGINT") == 1, stderr[-3000:]
    assert f"{aborted} {newest} (step {step})" in stderr, stderr[-3000:]
    assert "hint: run the same command again with --resume auto to continue from it" in stderr
    assert "SIGTERM" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert not (out / "summary.json").exists() and not (out / "model.safetensors").exists()
