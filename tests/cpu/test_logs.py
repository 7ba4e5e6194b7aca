"""Training logs and progress: file contents, resume cut-back, torn writes, optional TensorBoard, output modes."""

import csv
import io
import json
import logging
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest

from redline.errors import ConfigError
from redline.train.logs import open_loggers
from redline.train.progress import Progress

COLUMNS = ("step", "epoch", "loss", "lr", "samples_per_s", "tokens_per_s", "step_time_ms", "mem_gib")
EVAL_COLUMNS = ("step", "val_loss", "val_metric")


def rows(first: int, last: int) -> list[dict]:
    return [{"step": s, "epoch": 0, "loss": 1.0 / s, "lr": 1e-3} for s in range(first, last + 1)]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def steps_in(out: Path, stem: str = "metrics") -> tuple[list[int], list[int]]:
    return [int(r["step"]) for r in read_csv(out / f"{stem}.csv")], [
        r["step"] for r in read_jsonl(out / f"{stem}.jsonl")
    ]


def write_run(out: Path, last: int, **kwargs) -> None:
    with open_loggers(["csv", "jsonl"], out, columns=COLUMNS, eval_columns=EVAL_COLUMNS, **kwargs) as logs:
        logs.log(rows(1, last))
        for step in range(2, last + 1, 2):
            logs.log_eval(step, {"val_loss": 0.5 / step, "val_metric": None})


def test_rows_are_on_disk_after_each_call_with_full_precision(tmp_path):
    logs = open_loggers(["csv", "jsonl"], tmp_path, columns=COLUMNS)
    logs.log([{"step": 1, "epoch": 0, "loss": 0.1 + 0.2, "lr": 3e-4, "samples_per_s": 1234.5678901234567}])
    # read before close: a killed run keeps what was logged
    (row,) = read_csv(tmp_path / "metrics.csv")
    assert list(row) == list(COLUMNS)
    assert float(row["loss"]) == 0.1 + 0.2 and row["loss"] == repr(0.1 + 0.2)
    assert float(row["samples_per_s"]) == 1234.5678901234567
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["loss"] == 0.1 + 0.2
    logs.log(rows(2, 3))
    assert steps_in(tmp_path) == ([1, 2, 3], [1, 2, 3])
    logs.close()
    logs.close()
    with pytest.raises(ValueError, match="closed"):
        logs.log(rows(4, 4))


def test_extra_keys_reach_jsonl_only_and_missing_keys_stay_empty(tmp_path):
    with open_loggers(["csv", "jsonl"], tmp_path, columns=COLUMNS) as logs:
        logs.log([{"step": 1, "loss": 2.5, "grad_norm": 0.75, "note": "warmup", "mem_gib": None}])
    (row,) = read_csv(tmp_path / "metrics.csv")
    assert "grad_norm" not in row
    assert row["loss"] == "2.5" and row["epoch"] == "" and row["mem_gib"] == ""
    (obj,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert obj == {"step": 1, "loss": 2.5, "grad_norm": 0.75, "note": "warmup", "mem_gib": None}


def test_resume_drops_rows_written_after_the_checkpoint(tmp_path):
    write_run(tmp_path, 10)
    with open_loggers(["csv", "jsonl"], tmp_path, columns=COLUMNS, eval_columns=EVAL_COLUMNS, resume_step=6) as logs:
        logs.log(rows(7, 8))
        logs.log_eval(8, {"val_loss": 0.1, "val_metric": 0.9})
    assert steps_in(tmp_path) == (list(range(1, 9)), list(range(1, 9)))
    assert steps_in(tmp_path, "eval") == ([2, 4, 6, 8], [2, 4, 6, 8])
    assert float(read_csv(tmp_path / "metrics.csv")[6]["loss"]) == 1.0 / 7  # the new run's row, not the old one


@pytest.mark.parametrize(
    "torn",
    [
        {"metrics.csv": "11,0,0.0909", "metrics.jsonl": '{"step": 11, "lo'},  # killed mid-write: no newline
        {"metrics.csv": "garbage\n", "metrics.jsonl": "\x00\x00\x00\n"},  # a final line that does not parse
    ],
    ids=["cut-mid-line", "unreadable-last-line"],
)
def test_a_torn_last_line_does_not_break_the_resume(tmp_path, torn):
    write_run(tmp_path, 10)
    for name, tail in torn.items():
        with open(tmp_path / name, "a", encoding="utf-8", newline="") as handle:
            handle.write(tail)
    with open_loggers(["csv", "jsonl"], tmp_path, columns=COLUMNS, resume_step=10) as logs:
        logs.log(rows(11, 12))
    assert steps_in(tmp_path) == (list(range(1, 13)), list(range(1, 13)))


def test_a_row_cut_mid_number_is_dropped_not_kept_wrong(tmp_path):
    write_run(tmp_path, 9)
    with open(tmp_path / "metrics.csv", "a", encoding="utf-8") as handle:
        handle.write("10,0,0.1")  # row 10 cut before its lr; it parses, but it is not what was logged
    with open_loggers(["csv"], tmp_path, columns=COLUMNS, resume_step=10) as logs:
        logs.log(rows(11, 11))
    assert [r["step"] for r in read_csv(tmp_path / "metrics.csv")] == [str(s) for s in (*range(1, 10), 11)]


def test_an_unreadable_row_in_the_middle_stops_the_resume_with_a_hint(tmp_path):
    write_run(tmp_path, 4)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = "not json\n"
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    with pytest.raises(ConfigError, match=r"row 2 .*\nhint: fix or delete metrics.jsonl"):
        open_loggers(["jsonl"], tmp_path, resume_step=3)


def test_resume_with_no_old_files_starts_them(tmp_path):
    with open_loggers(["csv", "jsonl"], tmp_path, columns=COLUMNS, resume_step=6) as logs:
        logs.log(rows(7, 8))
    assert steps_in(tmp_path) == ([7, 8], [7, 8])


def test_a_new_run_replaces_the_old_files(tmp_path):
    write_run(tmp_path, 10)
    with open_loggers(["csv", "jsonl"], tmp_path, columns=COLUMNS) as logs:
        logs.log(rows(1, 2))
    assert steps_in(tmp_path) == ([1, 2], [1, 2])
    assert not (tmp_path / "eval.csv").exists()  # the old run's evaluations are not this run's


def test_eval_logs_have_their_own_columns(tmp_path):
    with open_loggers(["csv", "jsonl"], tmp_path, eval_columns=EVAL_COLUMNS) as logs:
        logs.log_eval(100, {"val_loss": 0.25, "val_metric": None})
    assert read_csv(tmp_path / "eval.csv") == [{"step": "100", "val_loss": "0.25", "val_metric": ""}]
    assert read_jsonl(tmp_path / "eval.jsonl") == [{"step": 100, "val_loss": 0.25, "val_metric": None}]
    assert not (tmp_path / "metrics.csv").exists()


def test_bad_arguments_say_what_is_allowed(tmp_path):
    with pytest.raises(ConfigError, match=r"logger='wandb'.*'csv', 'jsonl', 'tensorboard'"):
        open_loggers(["csv", "wandb"], tmp_path)
    with pytest.raises(ConfigError, match="columns="):
        open_loggers(["csv"], tmp_path, columns=("loss",))
    with open_loggers(["csv"], tmp_path) as logs, pytest.raises(ConfigError, match="step"):
        logs.log([{"loss": 1.0}])


def test_missing_tensorboard_says_how_to_install_it_and_keeps_old_logs(tmp_path, monkeypatch):
    write_run(tmp_path, 3)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match="hint: pip install tensorboard"):
        open_loggers(["csv", "tensorboard"], tmp_path)
    assert steps_in(tmp_path) == ([1, 2, 3], [1, 2, 3])


class FakeSummaryWriter:
    made: ClassVar[list["FakeSummaryWriter"]] = []

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        self.log_dir, self.purge_step = log_dir, purge_step
        self.scalars: list[tuple[str, float, int]] = []
        self.flushes = 0
        self.closed = False
        self.made.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


def test_tensorboard_gets_numeric_scalars_and_purges_on_resume(tmp_path, monkeypatch):
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    FakeSummaryWriter.made.clear()
    old_events = tmp_path / "tensorboard" / "events.out.tfevents.1.host"
    old_events.parent.mkdir()
    old_events.write_bytes(b"old run")
    with open_loggers(["tensorboard"], tmp_path) as logs:
        logs.log([{"step": 1, "loss": 2.0, "lr": 1e-3, "note": "x", "mem_gib": None, "flag": True}])
        logs.log_eval(1, {"val_loss": 1.5, "val_metric": None})
    (writer,) = FakeSummaryWriter.made
    assert writer.log_dir == str(tmp_path / "tensorboard") and writer.purge_step is None
    assert not old_events.exists()
    assert writer.scalars == [("loss", 2.0, 1), ("lr", 1e-3, 1), ("val/loss", 1.5, 1)]
    assert writer.flushes == 2 and writer.closed
    open_loggers(["tensorboard"], tmp_path, resume_step=6).close()
    assert FakeSummaryWriter.made[-1].purge_step == 7  # events after the checkpoint are hidden


def test_tensorboard_after_a_resume_that_evaluates_its_step_again_shows_that_evaluation_once(tmp_path):
    """Killed in step 4's evaluation, after its checkpoint: eval.csv drops the row and the resumed run evaluates
    step 4 again, but TensorBoard's purge from step 5 kept the first run's point beside the new one."""
    pytest.importorskip("tensorboard", reason="a run logs to TensorBoard with the tensorboard extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open_loggers(["csv", "tensorboard"], tmp_path) as logs:
        logs.log([{"step": s, "loss": 10.0 + s} for s in range(1, 5)])
        logs.log_eval(4, {"val_loss": 9.0})  # a half-written evaluation's row, say
    with open_loggers(["csv", "tensorboard"], tmp_path, resume_step=4, eval_resume_step=3) as logs:
        logs.log_eval(4, {"val_loss": 1.0})
        logs.log([{"step": s, "loss": 1.0 + s} for s in (5, 6)])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(4, 1.0)]
    losses = [(e.step, e.value) for e in events.Scalars("loss")]
    assert losses == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 6.0), (6, 7.0)]  # step 4's kept, not redone
    with (tmp_path / "eval.csv").open() as file:
        assert [row["step"] for row in csv.DictReader(file)] == ["4"]


def test_plain_lines_show_step_loss_rate_and_eta():
    out = io.StringIO()
    progress = Progress(1000, stream=out)
    progress.update(100, loss=2.3456, samples_per_s=1234.0, epoch=1, step_ms=100.0)  # 900 steps of 0.1 s left
    progress.close()
    assert out.getvalue() == "step 100/1000  epoch 1  loss 2.3456  1,234 samples/s  eta 0:01:30\n"


def test_the_eta_counts_from_the_resumed_step_and_spreads_the_evaluations_over_its_steps():
    out = io.StringIO()
    progress = Progress(1000, stream=out, start_step=500)
    progress.update(600, loss=None, samples_per_s=0.75, epoch=3, step_ms=50.0, excluded_s=5.0)  # 0.05 + 5/100 s
    assert out.getvalue() == "step 600/1000  epoch 3  0.75 samples/s  eta 0:00:40\n"


def test_the_eta_runs_at_the_latest_windows_step_time_not_the_compile_and_warm_up_before():
    """A compiled run showed 'eta 0:00:50' at step 10 of 60: its first window held 8 s of compile and warm-up, which
    do not recur; the steps after ran at 4 ms."""
    out = io.StringIO()
    progress = Progress(60, stream=out)
    progress.update(10, loss=None, samples_per_s=None, epoch=1, step_ms=None)  # a window of no timed step
    progress.update(20, loss=None, samples_per_s=16000.0, epoch=1, step_ms=4.0)
    assert out.getvalue().splitlines() == ["step 10/60  epoch 1", "step 20/60  epoch 1  16,000 samples/s  eta 0:00:00"]
    assert progress.eta_s(20, 4.0) == pytest.approx(40 * 0.004)


def test_an_eta_past_any_runs_length_is_shown_as_such():
    """--max-steps 1e17: before, timedelta overflowed and the run stopped at its first progress line."""
    out = io.StringIO()
    Progress(10**17, stream=out).update(100, loss=None, samples_per_s=None, epoch=1, step_ms=100.0)
    assert out.getvalue() == f"step 100/{10**17}  epoch 1  eta >999 days\n"


def test_disabled_progress_prints_only_messages():
    out = io.StringIO()
    progress = Progress(1000, enabled=False, stream=out)
    progress.update(100, loss=2.0, samples_per_s=10.0, epoch=1)
    progress.message("saved checkpoint at step 100")
    progress.close()
    assert out.getvalue() == "saved checkpoint at step 100\n"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_rich_bar():
    out = FakeTerminal()
    with Progress(1000, stream=out) as progress:
        progress.update(100, loss=2.3456, samples_per_s=1234.0, epoch=1)
        progress.message("[not markup] evaluating")
    text = out.getvalue()
    assert "\x1b[" in text  # drawn with terminal control codes, not plain lines
    assert "100/1000" in text and "loss 2.3456" in text and "[not markup] evaluating" in text


@pytest.mark.parametrize("stream_class", [io.StringIO, FakeTerminal], ids=["plain", "terminal"])
def test_a_closed_stream_never_breaks_the_run(stream_class):
    out = stream_class()
    progress = Progress(1000, stream=out)
    out.close()
    progress.update(100, loss=2.0, samples_per_s=10.0, epoch=1)
    progress.message("still running")
    progress.close()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, whose writes fail as on a full disk")
def test_a_log_write_the_disk_refuses_is_a_clear_error_naming_the_file(tmp_path):
    from redline.errors import TrainingError

    # a TrainingError, not an OSError from the write or from the close after it (which would hide the first)
    with pytest.raises(TrainingError) as raised, open_loggers(["csv", "jsonl"], tmp_path, columns=COLUMNS) as logs:
        (tmp_path / "metrics.csv").symlink_to("/dev/full")  # a disk with no space left
        logs.log(rows(1, 2))
    assert str(raised.value).startswith(f"{tmp_path / 'metrics.csv'} could not be written: No space left on device")
    assert "hint: free space on that disk" in str(raised.value) and "--resume auto" in str(raised.value)
    with pytest.raises(ValueError, match="closed"):  # every file closed on the way out, the refused one too
        logs.log(rows(3, 3))


def test_a_resume_without_a_logger_the_run_before_wrote_warns_that_its_files_miss_the_steps(tmp_path, caplog):
    """Before, a resume with --logger csv left metrics.jsonl short of its steps, and a later one a gap in it, unsaid."""
    write_run(tmp_path, 6)
    with caplog.at_level(logging.WARNING, logger="redline"):
        open_loggers(["csv", "jsonl"], tmp_path, columns=COLUMNS, resume_step=4).close()  # the same: no word
        assert caplog.records == []
        open_loggers(["csv"], tmp_path, columns=COLUMNS, resume_step=4).close()
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(
        f"{tmp_path}: metrics.jsonl, eval.jsonl, written by the run before, miss the steps from 5 on: this run "
        "writes the loggers csv\nhint: resume with the loggers the run began with"
    )
