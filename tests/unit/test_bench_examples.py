"""benchmarks/bench_examples.py's verdict: auto's twin is an explicit row that runs exactly what auto ran."""

import sys
from pathlib import Path

from redline.bench.run import BenchRow

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from bench_examples import runs_alike


def row(kind: str = "explicit", micro_batches: int = 1, **changes) -> BenchRow:
    fields = dict(name=kind, kind=kind, device="cpu", precision="bf16-mixed", compile=False, channels_last=False)
    plan = {"grad_accum": {"value": micro_batches, "reason": ""}}
    return BenchRow(**{**fields, **changes}, batch_size=64, plan=plan)


def test_an_explicit_row_is_autos_twin_only_when_it_runs_the_same_configuration():
    auto = row("auto")
    assert runs_alike(row(), auto)
    assert not runs_alike(row(precision="fp32"), auto)
    assert not runs_alike(row(compile=True), auto)
    assert not runs_alike(row(channels_last=True), auto)


def test_a_micro_batched_auto_has_no_twin_among_rows_that_take_the_batch_whole():
    assert not runs_alike(row(), row("auto", micro_batches=2))
