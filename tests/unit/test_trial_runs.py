"""Short runs of one workload add up: the run that brings them to what repays a trial measures (runtime/measure.py)."""

import json
import time

import torch
from test_trial import tiny_task  # the same tiny task

from redline.parallel.env import DistEnv
from redline.runtime import measure
from redline.runtime.measure import RUNS, measure_auto, measure_run
from redline.runtime.options import RuntimeOptions
from redline.train.trainer import Trainer


def run(planned: float, *, counts: bool = True, trial: str = "auto", batch: int = 16):
    """The precision the Trainer's run of ``planned`` steps of the tiny task would take."""
    options, env = RuntimeOptions(devices="cpu"), DistEnv()
    if counts:  # a Trainer's run
        return measure_run(tiny_task(), options, batch, planned, env, trial=trial)[0]["precision"]
    return measure_auto(tiny_task(), options, batch, planned, env, trial=trial)["precision"]  # a bench's


def test_the_run_that_brings_a_workloads_runs_to_what_repays_a_trial_measures(asked_rounds):
    first = run(176)  # a trial of 3 rounds (26 steps) needs 260
    assert first.value == "fp32" and asked_rounds == []
    assert first.reason.endswith(
        "not measured: a trial costs 26 steps or more, which a run of 260 repays, not this one of 176; this workload's "
        "next run here to bring them to 260, of 26 steps or more, measures (--trial on measures anyway)"
    )
    second = run(176)  # 352 steps in all: four rounds (34 steps) fit
    assert second.value == "bf16-mixed" and asked_rounds == [4]
    assert second.reason.startswith("measured: bf16-mixed ran 1.43x fp32")
    assert second.reason.endswith(
        "; measured by this run of 176 steps, as this workload's runs here add up to 352 steps with the earlier "
        "ones' 176"
    )
    third = run(176)
    assert third.value == "bf16-mixed" and "cached from" in third.reason and "measured by this run" not in third.reason
    assert asked_rounds == [4]  # the third paid nothing


def test_the_steps_that_paid_for_a_trial_pay_for_no_other(asked_rounds, tmp_path):
    """The tally stayed at what it was: with no final verdict cached (a busy machine's, one out of memory), every run
    as long as a trial measured again, each saying the same earlier steps paid for it."""
    run(176)
    assert run(176).value == "bf16-mixed" and asked_rounds == [4]
    (tally,) = (tmp_path / RUNS).iterdir()
    assert json.loads(tally.read_text())["measured"] == [0]
    for entry in (tmp_path / "trials").iterdir():  # as though the trial had not been cached
        entry.unlink()
    again = run(40)
    assert again.value == "fp32" and asked_rounds == [4] and "not this one of 40;" in again.reason


def test_runs_add_up_by_workload_and_a_run_shorter_than_the_trial_never_pays_for_it(asked_rounds):
    for _ in range(20):  # 400 steps: enough to repay a trial, but each run is shorter than one
        short = run(20)
    assert short.value == "fp32" and asked_rounds == []
    assert "more than this run of 20; this workload's runs here add up to 400 steps: " in short.reason
    assert short.reason.endswith("its next of 26 steps or more measures (--trial on measures anyway)")
    other = run(176, batch=32)  # another batch is another workload: its runs start from none
    assert other.value == "fp32" and "not this one of 176; this workload's next run" in other.reason
    assert run(30).value == "bf16-mixed" and asked_rounds == [3]  # 430 steps repay four rounds; this run pays for three


def test_a_bench_reads_the_runs_but_adds_none_and_a_run_asked_to_measure_counts_none(asked_rounds):
    for _ in range(3):
        bench = run(176, counts=False)
    assert bench.value == "fp32" and asked_rounds == []
    assert "not this one of 176 (--trial on measures anyway)" in bench.reason  # nothing said of later runs
    run(100)  # a run adds its own steps: 100
    told = run(100, counts=False).reason  # a bench of the same planned run reads them
    assert "not this one of 100 with the earlier runs' 100 of this workload here (" in told
    assert run(176, counts=False).value == "bf16-mixed" and asked_rounds == [
        3
    ]  # 276: the bench measures as the run would


def test_an_unreadable_tally_counts_nothing(asked_rounds, tmp_path):
    run(176)
    (tally,) = (tmp_path / RUNS).iterdir()
    assert json.loads(tally.read_text())["measured"] == [176]
    for broken in ('{"measured": ["many"], "measured_at": ""}', "{not json", '{"measured": [-400], "measured_at": ""}'):
        tally.write_text(broken)
        assert run(176).value == "fp32" and asked_rounds == []  # as a first run: 176 alone does not repay
    tally.write_text('{"measured": [1e400], "measured_at": ""}')  # inf: nothing to count on
    assert run(176).value == "fp32"
    assert run(176).value == "bf16-mixed" and asked_rounds == [4]


def test_the_trainer_counts_its_runs_and_the_second_short_one_measures(asked_rounds):
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(2816, 8, generator=gen), torch.randn(2816, 1, generator=gen))
    task = tiny_task(train_data=data)  # 176 steps of 16 in its one epoch
    plans = []
    for _ in range(2):
        with Trainer(task, max_epochs=1, progress=False) as trainer:
            plans.append(trainer.fit().plan.precision)
    assert [p.value for p in plans] == ["fp32", "bf16-mixed"] and asked_rounds == [4]
    assert "next run here to bring them to 260, of 26 steps or more, measures" in plans[0].reason
    assert "measured by this run of 176 steps" in plans[1].reason


def test_the_fits_end_to_end_time_counts_its_trial_and_says_how_long_the_trial_took(asked_rounds, monkeypatch):
    """The clock started after the trial: a fit of 52 s said 29 s end to end, its 23 s of trial said nowhere."""
    timed = measure.run_trial

    def slow_trial(*args, **kwargs):
        time.sleep(0.4)
        return timed(*args, **kwargs)

    monkeypatch.setattr(measure, "run_trial", slow_trial)
    began = time.perf_counter()
    with Trainer(tiny_task(), max_steps=3, trial="on", progress=False) as trainer:
        summary = trainer.fit()
    fit_seconds = time.perf_counter() - began
    assert asked_rounds == [4] and summary.trial_seconds is not None and summary.trial_seconds >= 0.4
    assert summary.trial_seconds < summary.train_seconds <= fit_seconds
    with Trainer(tiny_task(), max_steps=3, trial="on", progress=False) as trainer:
        assert trainer.fit().trial_seconds is None  # read from the cache: no trial ran
    with Trainer(tiny_task(), max_steps=3, progress=False, runtime=RuntimeOptions(precision="fp32")) as trainer:
        assert trainer.fit().trial_seconds is None  # a precision given: nothing to try
