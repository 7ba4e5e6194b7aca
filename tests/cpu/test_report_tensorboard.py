"""`redline report` on a run that logged to TensorBoard alone: its curves come from the run's events."""

import os
import sys
import time

import pytest

import redline
from redline.errors import ConfigError
from redline.render.run_files import read_run
from redline.train.logs import open_loggers
from report_samples import images

pytest.importorskip("matplotlib", reason="the report's charts need the report extra: pip install 'redline[report]'")
pytest.importorskip("tensorboard", reason="a run logs to TensorBoard with the tensorboard extra")


def log_steps(loggers, steps, loss_of):
    loggers.log([{"step": s, "epoch": 0, "loss": loss_of(s), "samples_per_s": 100.0 * s} for s in steps])


def test_a_run_that_logged_to_tensorboard_alone_is_reported_from_its_events(tmp_path):
    # It was refused ("has no metrics.jsonl or metrics.csv"), though its events hold every curve.
    with open_loggers(["tensorboard"], tmp_path) as loggers:
        log_steps(loggers, [1, 2, 3, 4], lambda s: 2.0 / s)
        loggers.log_eval(4, {"val_loss": 0.75})
    files = read_run(tmp_path)
    assert [row["step"] for row in files.train] == [1, 2, 3, 4]
    assert [row["loss"] for row in files.train] == pytest.approx([2.0, 1.0, 2 / 3, 0.5])
    assert [row["samples_per_s"] for row in files.train] == pytest.approx([100.0, 200.0, 300.0, 400.0])
    assert files.evals == [{"step": 4, "val_loss": 0.75}]
    assert files.summary is None and files.train_file == "tensorboard/"
    doc = redline.report(tmp_path).read_text(encoding="utf-8")
    alts = [image["alt"] for image in images(doc)]
    assert "train loss over 4 points" in alts[0] and "val loss over 1 point," in alts[0]
    assert "Read from tensorboard/ in" in doc and "tensorboard/ and tensorboard/" not in doc


def test_a_resumed_tensorboard_run_shows_the_steps_the_resume_wrote_again_once(tmp_path):
    with open_loggers(["tensorboard"], tmp_path) as loggers:  # killed after step 5, its checkpoint at 3
        log_steps(loggers, [1, 2, 3, 4, 5], lambda s: 10.0)
    with open_loggers(["tensorboard"], tmp_path, resume_step=3) as loggers:
        log_steps(loggers, [4, 5, 6], lambda s: 1.0)
    files = read_run(tmp_path)
    steps = [(row["step"], row["loss"]) for row in files.train]
    assert steps == [(1, 10.0), (2, 10.0), (3, 10.0), (4, 1.0), (5, 1.0), (6, 1.0)]  # 4 and 5 of the resume


def test_a_run_with_neither_logs_nor_events_is_still_refused(tmp_path):
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"has no metrics\.jsonl or metrics\.csv"):
        read_run(tmp_path)


def test_a_tensorboard_run_without_the_tensorboard_package_says_how_to_install_it(tmp_path, monkeypatch):
    with open_loggers(["tensorboard"], tmp_path) as loggers:
        log_steps(loggers, [1], lambda s: 1.0)
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_accumulator", None)
    with pytest.raises(ConfigError, match=r"logged to TensorBoard alone .*\nhint: pip install tensorboard"):
        read_run(tmp_path)


def test_logs_an_earlier_run_left_beside_newer_events_are_not_drawn_as_the_run(tmp_path):
    # A run with the default --logger, then one with --logger tensorboard alone in the same --out: the report
    # drew the first run's metrics.csv under the second run's summary.
    with open_loggers(["csv", "jsonl"], tmp_path) as loggers:
        log_steps(loggers, [1, 2, 3], lambda s: 10.0)
        loggers.log_eval(3, {"val_loss": 9.0})
    earlier = time.time() - 60
    for name in ("metrics.csv", "metrics.jsonl", "eval.csv", "eval.jsonl"):
        os.utime(tmp_path / name, (earlier, earlier))
    with open_loggers(["tensorboard"], tmp_path) as loggers:
        log_steps(loggers, [1, 2, 3, 4, 5], lambda s: 1.0)
    files = read_run(tmp_path)
    assert files.train_file == "tensorboard/" and [row["loss"] for row in files.train] == [1.0] * 5
    assert files.evals == []


def test_a_run_that_logged_to_files_and_tensorboard_is_read_from_its_files(tmp_path):
    with open_loggers(["csv", "jsonl", "tensorboard"], tmp_path) as loggers:
        log_steps(loggers, [1, 2], lambda s: 1.0)
        loggers.log_eval(2, {"val_loss": 0.5})
    earlier = time.time() - 60  # the last step logged long before the evaluation at the end (eval.*, the events)
    for name in ("metrics.jsonl", "metrics.csv"):
        os.utime(tmp_path / name, (earlier, earlier))
    files = read_run(tmp_path)
    assert files.train_file == "metrics.jsonl" and files.eval_file == "eval.jsonl"
    assert [row["step"] for row in files.train] == [1, 2] and files.evals == [{"step": 2, "val_loss": 0.5}]


def test_events_damaged_in_a_finished_run_are_said_to_be_unreadable_not_a_run_yet_to_log(tmp_path):
    """The accumulator skips what it cannot parse: a page said '23 steps' beside 'holds no step yet'."""
    with open_loggers(["tensorboard"], tmp_path) as loggers:
        log_steps(loggers, [1, 2, 3], lambda s: 1.0 / s)
    (tmp_path / "summary.json").write_text('{"task": "t", "steps": 3}', encoding="utf-8")
    for events in (tmp_path / "tensorboard").glob("events.out.tfevents.*"):
        events.write_bytes(os.urandom(1000))
    with pytest.raises(ConfigError, match=r"tensorboard cannot be read: its events hold no scalar, though summary.json "
                                          r"says the run trained 3 steps"):  # fmt: skip
        read_run(tmp_path)
