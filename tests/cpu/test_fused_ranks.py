"""Under several processes rank 0 times the optimizer's fused kernel and every rank steps as it chose: the two
implementations round differently, so replicas stepping each their own way would drift apart."""

from __future__ import annotations

from pathlib import Path

from two_ranks import run_two_ranks

JOB = Path(__file__).with_name("fused_rank_job.py")


def run_job(tmp_path: Path, mode: str) -> list[str]:
    out = tmp_path / mode  # a store of its own: a file store another job wrote would answer this one's keys
    out.mkdir()
    return run_two_ranks(JOB, out, mode)


def test_every_rank_takes_rank_zeros_implementation(tmp_path):
    assert run_job(tmp_path, "fresh") == ["fused True"] * 2


def test_a_rank_whose_optimizer_stepped_is_told_at_once_and_none_waits(tmp_path):
    """Each rank deciding by its own optimizer, one that had stepped kept it as given and skipped the timing's
    collective, while the other waited in it until the process group's timeout (30 s here, 30 minutes by default)."""
    assert run_job(tmp_path, "stepped0") == ["as given False"] * 2  # rank 0's optimizer decides: kept, on both
    rank0, rank1 = run_job(tmp_path, "stepped1")
    assert rank0 == "fused True"
    assert rank1 == "ConfigError: cannot rebuild AdamW: it already holds state"
