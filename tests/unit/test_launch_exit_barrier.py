"""torchrun's exit barrier where a signal stopped the job on another machine: short, and a signal ends it at once."""

import os
import signal
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing import SignalException

from redline.launch import barrier
from redline.launch.stopped import unfinished
from redline.parallel.env import received_mark, stopped_mark


def agent_alone(timeout_s: float) -> SimpleNamespace:
    """An agent of a job on two machines whose other machine's launcher never comes to the barrier."""
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    return SimpleNamespace(_store=store, _worker_group=SimpleNamespace(group_world_size=2),
                           _exit_barrier_timeout=timeout_s)  # fmt: skip


def test_a_run_a_signal_stopped_waits_at_the_exit_barrier_seconds_not_minutes(tmp_path, monkeypatch):
    """Before, the machine whose launcher was not signalled waited torchrun's 300 s for the one that was, which had
    ended on the signal, then printed torch's traceback."""
    monkeypatch.setattr(barrier, "STOPPED_BARRIER_S", 0.5)
    finished = tmp_path / "finished"
    stopped_mark(finished).touch()
    started = time.monotonic()
    barrier._exit_barrier(agent_alone(300), finished)
    assert time.monotonic() - started < 10


def test_a_sigterm_ends_the_exit_barrier_at_once(tmp_path):
    """Before, torch waited inside its C++ store, where a SIGTERM was acted on only after the barrier's 300 s."""

    def torchruns(signum: int, frame: object) -> None:
        raise SignalException("stop", signal.Signals(signum))

    previous = signal.signal(signal.SIGTERM, torchruns)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    started = time.monotonic()
    try:
        with pytest.raises(SignalException):
            barrier._exit_barrier(agent_alone(300), tmp_path / "finished")  # a finished run: the full 300 s
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert time.monotonic() - started < 10


def test_a_machine_whose_ranks_stopped_for_another_machines_signal_says_so(tmp_path):
    """Before: 'stopped by a signal sent to the workers, not to the launcher', where the user had signalled the
    other machine's launcher."""
    finished = tmp_path / "finished"
    stopped_mark(finished).touch()
    elsewhere = str(unfinished(finished, trainer=True, several=True))
    assert elsewhere.startswith("stopped on another machine of the job: a signal reached a rank there")
    assert "not to the launcher" not in elsewhere
    received_mark(finished).touch()  # a signal sent to this machine's workers themselves: as before
    assert "stopped by a signal sent to the workers, not to the launcher" in str(
        unfinished(finished, trainer=True, several=True)
    )


def test_a_torch_without_the_private_names_keeps_its_own_barrier(tmp_path, monkeypatch):
    # torch>=2.6 is supported: where the names the polled barrier uses are gone, torch's own barrier runs.
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.utils import store

    called = []
    monkeypatch.setattr(api.SimpleElasticAgent, "_exit_barrier", lambda agent: called.append(agent))
    monkeypatch.delattr(store, "_barrier_nonblocking")
    agent = agent_alone(300)
    with barrier.polled_exit_barrier(tmp_path / "finished"):
        api.SimpleElasticAgent._exit_barrier(agent)
    assert called == [agent]
