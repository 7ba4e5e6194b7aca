"""Rank 0 looks up the cached trial and tuned Plan for every rank; its failing there leaves no rank waiting."""

from __future__ import annotations

from pathlib import Path

import pytest
from two_ranks import run_two_ranks

JOB = Path(__file__).with_name("rank_zero_job.py")


@pytest.mark.parametrize("lookup", ["tuned", "trial"])
def test_rank_zero_failing_in_a_lookup_it_does_for_all_stops_every_rank(tmp_path, lookup):
    rank0, rank1 = run_two_ranks(JOB, tmp_path, lookup)
    assert rank0.startswith("TrainingError") and "rank zero's config" in rank0
    assert rank1.startswith("RankZeroError"), rank1  # told at once, not left to gloo's timeout
    assert "failed on rank 0" in rank1 and "rank zero's config" in rank1
