"""benchmarks/bench_examples.py's verdict: auto's twin is an explicit row that runs exactly what auto ran."""

import dataclasses
import sys
from pathlib import Path

from redline.bench.result import BenchResult
from redline.bench.run import BenchRow

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from bench_examples import planned_run, runs_alike, table, verdict


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


def timed(name: str, kind: str, step_ms: float, **changes) -> BenchRow:
    fields = dict(name=name, kind=kind, device="cuda", precision="fp32", compile=False, channels_last=False)
    figures = dict(samples_per_s=64e3 / step_ms, step_ms_p50=step_ms, step_ms_p90=step_ms, speedup_naive=1.0, loss=1.0)
    return BenchRow(**{**fields, **figures, **changes}, batch_size=64)


def bench(*rows: BenchRow) -> BenchResult:
    return BenchResult("t", 10, 5, "2026-12-06", {}, {}, rows)


def test_the_planned_run_charges_auto_its_trial_as_it_charges_compiled_rows_their_compile():
    # auto within 5% of the best, "compile included": auto's 30 s trial was left out, so it read as met.
    eager = timed("cuda fp32 eager b64", "explicit", 10.0)
    auto = timed("auto cuda b64", "auto", 10.0, trial_s=30.0, trial_cached=False)
    told = " ".join(planned_run(bench(eager, auto), 1000))
    assert "auto cuda b64 40.0 s (trial 30.0 s included)" in told and "NOT met" in told
    cached = " ".join(planned_run(bench(eager, dataclasses.replace(auto, trial_s=0.01, trial_cached=True)), 1000))
    assert "(trial 0.0* s included)" in cached and "goal: >= 95%, met" in cached


def test_the_planned_run_charges_each_row_its_own_first_step_as_it_charges_auto_its_trial():
    # auto's trial built its bf16 kernels, so its first step was cheap; the explicit bf16 row's warm-up built them
    # unrecorded: auto read 91.6% of the best where both pay the same one-off work.
    eager = timed("cpu bf16-mixed eager b64", "explicit", 4.0, first_step_s=0.2)
    auto = timed("auto cpu b64", "auto", 4.0, trial_s=0.2, trial_cached=False, first_step_s=0.004)
    told = " ".join(planned_run(bench(eager, auto), 100))
    assert "compile, auto's trial and each row's first step included" in told
    both = "cpu bf16-mixed eager b64 0.6 s (first step 0.20 s included); auto cpu b64 0.6 s (first step 0.00 s, "
    assert both + "trial 0.2 s included)" in told and "Auto takes 99.3%" in told
    unknown = dataclasses.replace(eager, first_step_s=None)  # a row without one: its first step as its p50
    assert "cpu bf16-mixed eager b64 0.4 s" in " ".join(planned_run(bench(unknown, auto), 100))


def test_the_table_marks_cached_compiles_and_trials_and_fp32_run_in_tf32_as_the_cli_does():
    tf32 = {axis: {"value": True, "reason": f"{axis} (made up)"} for axis in ("tf32", "precision", "compile")}
    naive = timed("naive cuda fp32 b64", "naive", 20.0)
    compiled = timed("cuda fp32 compiled b64", "explicit", 8.0, compile=True, compile_s=0.3, compile_cached=True,
                     plan=tf32)  # fmt: skip
    auto = timed("auto cuda b64", "auto", 8.0, compile=True, compile_s=0.3, compile_cached=True, trial_s=0.02,
                 trial_cached=True, plan=tf32)  # fmt: skip
    text = "\n".join(table(bench(naive, compiled, auto)))
    assert "| cuda fp32 compiled b64 | fp32 (TF32) | yes |" in text and "| naive cuda fp32 b64 | fp32 | no |" in text
    assert "| 0.3* | 0.0* |" in text and "| 0.3* |  |" in text
    assert "- `*` beside a compile's seconds: torch's on-disk compile caches" in text
    assert "- `*` beside a trial's seconds: redline's trial cache" in text
    assert "- fp32 (TF32): the row's fp32 matmuls ran in TF32" in text
    assert "auto ran fp32 (TF32), compiled" in verdict(bench(naive, compiled, auto))[0]
    plain = "\n".join(table(bench(naive, timed("cuda fp32 eager b64", "explicit", 8.0))))
    assert "*" not in plain.replace("**", "") and "TF32" not in plain  # bold speed-ups aside, no mark


def test_auto_a_hair_below_the_naive_loop_is_slower_only_where_its_interval_lies_wholly_below():
    naive = timed("naive cuda fp32 b64", "naive", 10.0)
    eager = timed("cuda fp32 eager b64", "explicit", 10.1, speedup_naive=0.99)
    auto = timed("auto cuda b64", "auto", 10.1, speedup_naive=0.99, speedup_naive_interval=(0.97, 1.01))
    said = verdict(bench(naive, eager, auto))[0]
    assert "**0.990x** the naive loop (round by round: 0.970-1.010x, the median's 95% interval)" in said
    assert "(goal: >= 1, met: not measurably slower)" in said
    slower = dataclasses.replace(auto, speedup_naive_interval=(0.96, 0.995))
    assert "(goal: >= 1, NOT met)" in verdict(bench(naive, eager, slower))[0]
    unsure = dataclasses.replace(auto, speedup_naive_interval=None)  # too few rounds to say: the point alone decides
    assert "(goal: >= 1, NOT met)" in verdict(bench(naive, eager, unsure))[0]


def test_each_rows_speedup_shows_its_interval_where_the_bench_gave_one():
    naive = timed("naive cuda fp32 b64", "naive", 10.0)
    eager = timed("cuda fp32 eager b64", "explicit", 9.0, speedup_naive=1.111, speedup_naive_interval=(1.05, 1.17))
    text = "\n".join(table(bench(naive, eager)))
    assert "| **1.111x** (1.05-1.17) |" in text and "| **1.000x** |" in text  # the naive loop has none
