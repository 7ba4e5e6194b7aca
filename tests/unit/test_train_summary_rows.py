"""The summary table `redline train` prints reads as a sentence a user would write."""

from __future__ import annotations

import pytest

from redline.cli.train import summary_rows
from redline.plan import Choice, Plan
from redline.train.summary import TrainSummary

PLAN = Plan(
    device=Choice("cpu", "requested"),
    precision=Choice("fp32", "requested"),
    tf32=Choice(False, "not available on cpu"),
    grad_accum=Choice(1, "default"),
    clip_grad_norm=Choice(None, "default"),
)


@pytest.mark.parametrize(
    ("epochs", "said"),
    [(1.0, "1 epoch, "), (2.0, "2 epochs, "), (0.4, "0.4 epochs, "), (1.2, "1.2 epochs, "), (None, "streamed, ")],
)
def test_the_steps_row_counts_epochs_in_words(epochs, said):
    figures = {"task": "t", "plan": PLAN.to_dict(), "steps": 5, "epochs": epochs, "samples": 40, "stopped": "epochs"}
    figures["train_seconds"] = 1.0
    summary = TrainSummary.from_dict(figures)
    steps = dict(summary_rows(summary))["steps"]
    assert steps == f"5 ({said}40 samples; stopped: epochs)"


@pytest.mark.parametrize(("ratio", "said"), [(0.0004, "<0.1%"), (0.0005, "0.1%"), (0.4231, "42.3%"), (0.0, "0.0%")])
def test_a_share_too_small_for_one_decimal_is_said_as_under_it_not_as_none(ratio, said):
    figures = {"task": "t", "plan": PLAN.to_dict(), "steps": 5, "epochs": 1.0, "samples": 40, "stopped": "epochs"}
    figures.update(train_seconds=1.0, measured_peak_ratio=ratio, mfu=ratio or None, mfu_peak_tflops=989.0)
    rows = dict(summary_rows(TrainSummary.from_dict(figures)))
    assert rows["of measured matmul peak"] == said
    assert rows["MFU"] == (f"{said} of 989 TFLOP/s" if ratio else "n/a")


def test_a_resumed_runs_rates_and_time_say_they_are_the_stretch_since_the_resume():
    # The summary's samples/s and train time are the last process's: a resumed run's cover its last stretch only.
    figures = {"task": "t", "plan": PLAN.to_dict(), "steps": 69, "epochs": 3.0, "samples": 4414, "stopped": "epochs"}
    figures.update(train_seconds=0.68, samples_per_s=9000.0, resumed_from="run/checkpoints/step-00000022")
    rows = dict(summary_rows(TrainSummary.from_dict(figures)))
    assert rows["samples/s"] == "9,000 (training steps after the first since the resume from step-00000022)"
    assert rows["train time"].startswith("0.7 s end to end since the resume from step-00000022")
    figures["compile_seconds"] = 4.04
    compiled = dict(summary_rows(TrainSummary.from_dict(figures)))["compile time"]
    assert compiled == "4.0 s since the resume from step-00000022"
    del figures["resumed_from"]
    assert dict(summary_rows(TrainSummary.from_dict(figures)))["samples/s"] == "9,000 (training steps after the first)"


def test_a_resumed_run_that_wrote_no_checkpoint_does_not_pass_the_one_it_resumed_from_for_its_own():
    """`--resume PATH` without --out printed `steps 15` beside `checkpoint .../step-00000012`: steps 13-15 unsaved."""
    figures = {"task": "t", "plan": PLAN.to_dict(), "steps": 15, "epochs": 1.0, "samples": 40, "stopped": "max_steps"}
    old = "r4/checkpoints/step-00000012"
    figures.update(train_seconds=1.0, resumed_from=old, checkpoint=old)
    rows = dict(summary_rows(TrainSummary.from_dict(figures)))
    assert rows["checkpoint"] == f"{old} (the one resumed from: none written since)"
    figures["checkpoint"] = "r4/checkpoints/step-00000015"
    assert dict(summary_rows(TrainSummary.from_dict(figures)))["checkpoint"] == "r4/checkpoints/step-00000015"


def test_a_summary_without_rates_or_mfu_says_why():
    figures = {"task": "t", "plan": PLAN.to_dict(), "steps": 1, "epochs": 0.1, "samples": 8, "stopped": "max_steps"}
    figures.update(train_seconds=1.0, mfu_note="no step after the first, which warms up and is not timed")
    rows = dict(summary_rows(TrainSummary.from_dict(figures)))
    assert rows["samples/s"] == "n/a (no step after the first, which warms up and is not timed)"
    assert rows["MFU"] == "n/a (no step after the first, which warms up and is not timed)"
    figures.update(samples_per_s=900.0, mfu_note="no datasheet peak for a CPU")
    assert dict(summary_rows(TrainSummary.from_dict(figures)))["MFU"] == "n/a (no datasheet peak for a CPU)"
    del figures["mfu_note"]  # a summary.json from before the note
    assert dict(summary_rows(TrainSummary.from_dict(figures)))["MFU"] == "n/a"


def test_the_train_time_says_what_of_it_the_precision_trial_took_unless_the_cache_answered():
    figures = {"task": "t", "plan": PLAN.to_dict(), "steps": 5, "epochs": 1.0, "samples": 40, "stopped": "epochs"}
    figures.update(train_seconds=52.4, trial_seconds=23.0, eval_seconds=1.0, checkpoint_seconds=0.25)
    said = dict(summary_rows(TrainSummary.from_dict(figures)))["train time"]
    assert said == "52.4 s end to end, of which 23 s in the precision trial, 1 s evaluating and 0.25 s checkpointing"
    figures.update(trial_seconds=0.004, checkpoint_seconds=None)  # read from the cache: not worth a word
    assert (
        dict(summary_rows(TrainSummary.from_dict(figures)))["train time"]
        == "52.4 s end to end, of which 1 s evaluating"
    )
