"""Under several processes rank 0 times the optimizer's fused kernel and every rank steps as it chose: the two
implementations round differently, so replicas stepping each their own way would drift apart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).with_name("fused_rank_job.py")


def test_every_rank_takes_rank_zeros_implementation(tmp_path):
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, str(JOB), str(tmp_path)], env=env))
    for p in procs:
        p.wait(timeout=120)
    assert [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)] == ["fused True"] * 2
