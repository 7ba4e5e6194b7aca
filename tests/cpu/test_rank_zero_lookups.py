"""Rank 0 looks up the cached trial and tuned Plan for every rank; its failing there leaves no rank waiting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("rank_zero_job.py")


@pytest.mark.parametrize("lookup", ["tuned", "trial"])
def test_rank_zero_failing_in_a_lookup_it_does_for_all_stops_every_rank(tmp_path, lookup):
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, str(JOB), str(tmp_path), lookup], env=env))
    for p in procs:
        p.wait(timeout=120)
    rank0 = (tmp_path / "rank0.txt").read_text()
    rank1 = (tmp_path / "rank1.txt").read_text()
    assert rank0.startswith("TrainingError") and "rank zero's config" in rank0
    assert rank1.startswith("RankZeroError"), rank1  # told at once, not left to gloo's timeout
    assert "failed on rank 0" in rank1 and "rank zero's config" in rank1
