"""Workers end with their launcher: a launcher killed outright leaves none running on without it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie no one reaped (an orphan's new parent may not) has ended."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_the_workers_of_a_launcher_killed_by_sigkill_are_stopped_not_left_running(tmp_path):
    """Before, SIGKILL to the launcher (the out-of-memory killer's choice, a scheduler's kill of its process) left
    its workers running on as orphans: holding their GPUs, and writing into the --out a rerun resumed in."""
    script = tmp_path / "work.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        f"pathlib.Path({str(tmp_path)!r}, 'pid-' + os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    command = [sys.executable, "-m", "redline", "launch", "--nproc", "2", str(script)]
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        started = _wait_for(lambda: len([p for p in tmp_path.glob("pid-*") if p.read_text()]) == 2, timeout_s=120)
        pids = [int(path.read_text()) for path in tmp_path.glob("pid-*") if path.read_text()]
        assert started and len(pids) == 2, launcher.stderr.read() if launcher.poll() is not None else "not started"
        launcher.kill()
        launcher.wait(timeout=30)
        ended = _wait_for(lambda: not any(_alive(pid) for pid in pids), timeout_s=20)
        assert ended, f"workers {[pid for pid in pids if _alive(pid)]} still run without their launcher"
    finally:
        launcher.kill()
        for pid in pids:  # the workers this test started, should they outlive it
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
