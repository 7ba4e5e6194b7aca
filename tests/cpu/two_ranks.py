"""Two processes of one gloo job on this machine, ranks 0 and 1: how the rank-job tests start them, and how each
job joins the group.

A job is a script run as ``python JOB OUT ARGS...`` with RANK and WORLD_SIZE set, which writes what its rank saw or
raised to OUT/rank{R}.txt.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from redline.parallel.env import DistEnv, read_env


def run_two_ranks(job: Path, out: Path, *args: str, timeout: float = 120) -> list[str]:
    """Run ``job`` as ranks 0 and 1 with ``out`` and ``args``; return what each rank wrote, in rank order."""
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, str(job), str(out), *args], env=env))
    for proc in procs:
        proc.wait(timeout=timeout)
    return [(out / f"rank{rank}.txt").read_text() for rank in range(2)]


def join_group(out: Path, timeout_s: float) -> DistEnv:
    """Join the job's gloo group through a file store in ``out``; gloo's timeout ends a rank left waiting in a
    collective, so a hang cannot outlive the test."""
    env = read_env()
    store = dist.FileStore(str(out / "store"), env.world_size)
    dist.init_process_group(
        "gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=dt.timedelta(seconds=timeout_s)
    )
    return env
