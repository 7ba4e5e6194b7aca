"""Training metrics as CSV, JSONL and TensorBoard: appended and flushed per call, cut back to the checkpoint on resume.

A resumed run drops the rows the interrupted run wrote after its last checkpoint, so each log reads as one
unbroken run. Rows arrive in batches (one row per optimizer step, every ``log_every`` steps), so logging never
forces a device sync per step; only the process that owns the run (rank 0) should open loggers.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, get_args

from redline.atomic import write_atomic
from redline.errors import ConfigError, TrainingError, invalid

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

LoggerName = Literal["csv", "jsonl", "tensorboard"]
LOGGER_NAMES: tuple[str, ...] = get_args(LoggerName)
TRAIN_COLUMNS = ("step", "epoch", "loss", "lr", "samples_per_s", "tokens_per_s", "step_time_ms", "mem_gib")
EVAL_COLUMNS = ("step", "val_loss", "val_metric")

Value = float | int | str | None
Row = Mapping[str, Value]
T = TypeVar("T")
log = logging.getLogger("redline")


class _FileLog(Protocol):
    path: Path

    def write(self, rows: Sequence[Row]) -> None: ...
    def close(self) -> None: ...


class Loggers:
    """The run's open logs; build it with `open_loggers`, close it (or use ``with``) when the run ends."""

    def __init__(self, train: list[_FileLog], evals: list[_FileLog], tensorboard: SummaryWriter | None) -> None:
        self._train = train
        self._evals = evals
        self._tensorboard = tensorboard
        self._closed = False

    def log(self, rows: Sequence[Row]) -> None:
        """Append one row per optimizer step; each row needs an int "step". On disk when this returns."""
        self._check_open()
        for row in rows:
            _check_step(row.get("step"))
        if not rows:
            return
        _write(self._train, rows)
        if self._tensorboard is not None:
            for row in rows:
                self._add_scalars(row, prefix="", strip="")
            self._tensorboard.flush()

    def log_eval(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """Append the evaluation at ``step``; TensorBoard shows ``val_loss`` as ``val/loss``."""
        self._check_open()
        _check_step(step)
        row: dict[str, Value] = {"step": step, **metrics}
        _write(self._evals, [row])
        if self._tensorboard is not None:
            self._add_scalars(row, prefix="val/", strip="val_")
            self._tensorboard.flush()

    def close(self) -> None:
        """Close every file, even where one fails to (a full disk: a TrainingError after); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        failed: TrainingError | None = None
        for log in self._train + self._evals:
            try:
                log.close()
            except OSError as exc:  # what was left to flush could not be written
                failed = failed or _write_failure(log.path, exc)
        if self._tensorboard is not None:
            self._tensorboard.close()
        if failed is not None:
            raise failed

    def __enter__(self) -> Loggers:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:  # the error that ends the run says what happened; a failed close would hide it
            with contextlib.suppress(TrainingError):
                self.close()

    def _add_scalars(self, row: Row, *, prefix: str, strip: str) -> None:
        assert self._tensorboard is not None
        step = row["step"]
        for key, value in row.items():
            # bool is an int, but a flag is not a curve; strings and None have no scalar to plot
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tensorboard.add_scalar(prefix + key.removeprefix(strip), value, step)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("these Loggers are closed; open new ones with open_loggers()")


def _write(logs: Sequence[_FileLog], rows: Sequence[Row]) -> None:
    """Append ``rows`` to each of ``logs``; a write the system refuses (a full disk) is a TrainingError naming it."""
    for log in logs:
        try:
            log.write(rows)
        except OSError as exc:
            raise _write_failure(log.path, exc) from exc


def _write_failure(path: Path, exc: OSError) -> TrainingError:
    return TrainingError(
        f"{path} could not be written: {exc.strerror or exc}\nhint: free space on that disk (or make it writable "
        "again), then run the same command again with --resume auto: the run goes on from its newest checkpoint, "
        "and its logs from there (where it wrote none, it starts over)"
    )


def open_loggers(
    names: Sequence[str],
    out_dir: Path,
    *,
    columns: Sequence[str] = TRAIN_COLUMNS,
    eval_columns: Sequence[str] = EVAL_COLUMNS,
    resume_step: int | None = None,
    eval_resume_step: int | None = None,
) -> Loggers:
    """Open the named logs in ``out_dir``: metrics.csv/.jsonl, eval.csv/.jsonl, tensorboard/.

    Without ``resume_step`` old files are replaced (a new run). With it, rows past ``resume_step`` are dropped
    from each file, atomically, before anything is appended; the evaluation logs' past ``eval_resume_step``
    (default: ``resume_step``). ``columns`` fix the CSV header; JSONL keeps every key.
    """
    chosen = check_logger_names(names)
    for name, value in (("columns", columns), ("eval_columns", eval_columns)):
        if "step" not in value:
            raise invalid(name, tuple(value), "column names that include 'step'")
    if resume_step is not None:
        _check_step(resume_step, name="resume_step")
        eval_resume_step = resume_step if eval_resume_step is None else eval_resume_step
        _check_step(eval_resume_step, name="eval_resume_step")
    if resume_step is not None:
        _warn_unwritten(out_dir, chosen, resume_step)
    # Import before touching any file, so a missing package leaves the old run's logs as they were.
    writer_class = _summary_writer_class() if "tensorboard" in chosen else None
    if chosen:
        out_dir.mkdir(parents=True, exist_ok=True)
    train: list[_FileLog] = []
    evals: list[_FileLog] = []
    if "csv" in chosen:
        train.append(_CsvLog(out_dir / "metrics.csv", tuple(columns), resume_step))
        evals.append(_CsvLog(out_dir / "eval.csv", tuple(eval_columns), eval_resume_step))
    if "jsonl" in chosen:
        train.append(_JsonlLog(out_dir / "metrics.jsonl", resume_step))
        evals.append(_JsonlLog(out_dir / "eval.jsonl", eval_resume_step))
    tensorboard = None
    if writer_class is not None:
        tensorboard = _open_tensorboard(writer_class, out_dir / "tensorboard", resume_step, eval_resume_step)
    return Loggers(train, evals, tensorboard)


# The files and directories each logger writes in out_dir.
LOG_FILES = {
    "csv": ("metrics.csv", "eval.csv"),
    "jsonl": ("metrics.jsonl", "eval.jsonl"),
    "tensorboard": ("tensorboard",),
}


def logs_with_rows(out_dir: Path) -> list[str]:
    """The CSV and JSONL logs in ``out_dir`` that hold a row: an earlier run's steps, which a new run would replace.
    One of a header alone (a run that failed before its first log) holds none; an unreadable one is said to."""
    held = []
    for name in (*LOG_FILES["csv"], *LOG_FILES["jsonl"]):
        path = out_dir / name
        if not path.is_file():
            continue
        try:
            with path.open("rb") as file:
                lines = [line for line in (file.readline() for _ in range(2)) if line.strip()]
        except OSError:
            lines = [b"?", b"?"]  # what it holds is unknown: it is kept
        if len(lines) > (1 if name.endswith(".csv") else 0):  # a CSV's first line is its header
            held.append(name)
    return held


def stopped_on_nonfinite(out_dir: Path) -> bool:
    """Whether the training log in ``out_dir`` (metrics.csv, else metrics.jsonl) holds a loss that is not finite: a
    run stops at the first (``check_finite``, once its window is logged), so those are the logs of a run that failed
    (its hint says to run again), not the only record of one killed. An unreadable log is not known to."""
    for name, rows in (("metrics.csv", csv.DictReader), ("metrics.jsonl", _json_rows)):
        try:
            with (out_dir / name).open(newline="") as file:
                return any(not _finite(row.get("loss")) for row in rows(file) if isinstance(row, dict))
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError, csv.Error):
            return False
    return False


def _json_rows(lines: Iterable[str]) -> Iterator[object]:
    """The rows of a JSONL log, a line cut short (a killed write) left out."""
    for line in lines:
        with contextlib.suppress(ValueError):
            yield json.loads(line)


def _finite(value: object) -> bool:
    """Whether a logged loss is a finite number; a cell left empty or unreadable counts as one."""
    try:
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True


def _warn_unwritten(out_dir: Path, chosen: Sequence[str], resume_step: int) -> None:
    """Warn that the logs an earlier run wrote in ``out_dir``, and a resumed run does not, miss its steps."""
    left = [name for logger, names in LOG_FILES.items() if logger not in chosen for name in names]
    left = [name for name in left if (out_dir / name).exists()]
    if left:
        given = ", ".join(chosen) or "none"
        log.warning(
            "%s: %s, written by the run before, miss the steps from %d on: this run writes the loggers %s\n"
            "hint: resume with the loggers the run began with (--logger, loggers=...), so its logs read as one run",
            out_dir, ", ".join(left), resume_step + 1, given,
        )  # fmt: skip


class _CsvLog:
    """A CSV file whose columns are fixed when it is created; keys outside them are ignored, missing ones empty."""

    def __init__(self, path: Path, columns: tuple[str, ...], resume_step: int | None) -> None:
        self.path = path
        self.columns = columns
        _restart(path, resume_step, self._cut)
        self._file: io.TextIOWrapper | None = None
        self._writer: csv.DictWriter[str] | None = None

    def write(self, rows: Sequence[Row]) -> None:
        if self._writer is None or self._file is None:
            is_new = not self.path.exists() or self.path.stat().st_size == 0
            self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - open for the whole run
            self._writer = self._dict_writer(self._file)
            if is_new:
                self._writer.writeheader()
        self._writer.writerows(rows)  # floats as repr(): full precision
        # flush, not fsync: a killed process keeps what reached the OS, and an fsync per call would stall the loop
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def _dict_writer(self, file: io.TextIOBase) -> csv.DictWriter[str]:
        return csv.DictWriter(file, self.columns, restval="", extrasaction="ignore", lineterminator="\n")

    def _cut(self, text: str, resume_step: int) -> str:
        reader = csv.DictReader(io.StringIO(text))
        if reader.fieldnames is not None and "step" not in reader.fieldnames:
            raise _cannot_resume(self.path, f"its header {reader.fieldnames} has no 'step' column")
        kept = _rows_up_to(list(reader), resume_step, self.path, lambda row: int(row["step"]))
        out = io.StringIO()
        writer = self._dict_writer(out)  # the current columns, matched by name: the header may have changed
        writer.writeheader()
        writer.writerows(kept)
        return out.getvalue()


class _JsonlLog:
    """A JSON Lines file: one object per row, every key kept, missing keys simply absent."""

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        _restart(path, resume_step, self._cut)
        self._file: io.TextIOWrapper | None = None

    def write(self, rows: Sequence[Row]) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run
        # json writes floats as repr(), and NaN/Infinity as Python's json reads them: a diverged loss stays visible
        self._file.write("".join(json.dumps(dict(row)) + "\n" for row in rows))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def _cut(self, text: str, resume_step: int) -> str:
        lines = [line + "\n" for line in text.split("\n")[:-1]]
        return "".join(_rows_up_to(lines, resume_step, self.path, _json_step))


def _restart(path: Path, resume_step: int | None, cut: Callable[[str, int], str]) -> None:
    """Remove ``path`` for a new run; for a resumed one, rewrite it atomically as ``cut`` returns it."""
    if resume_step is None:
        path.unlink(missing_ok=True)
        return
    if not path.exists():
        return
    data = path.read_bytes()
    # Each row ends in a newline, so bytes after the last one are a row the killed run was writing.
    complete = data[: data.rfind(b"\n") + 1].decode("utf-8", errors="replace")
    text = cut(complete, resume_step)

    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8", newline="")

    write_atomic(path, write)


def _rows_up_to(items: list[T], resume_step: int, path: Path, step_of: Callable[[T], int]) -> list[T]:
    """Keep the items whose step is <= ``resume_step``, in order; an unreadable last item is skipped."""
    kept = []
    for index, item in enumerate(items):
        try:
            step = step_of(item)
        except (KeyError, TypeError, ValueError) as exc:
            if index == len(items) - 1:
                break  # a final row the interrupted run left unreadable
            raise _cannot_resume(path, f"row {index + 1} has no readable step ({exc})") from exc
        if step <= resume_step:
            kept.append(item)
    return kept


def _json_step(line: str) -> int:
    row = json.loads(line)
    step = row["step"]
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"step={step!r} is not an int")
    return step


def _cannot_resume(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"{path} cannot be cut back for the resumed run: {why}\n"
        f"hint: fix or delete {path.name}, or start a new run in another out_dir"
    )


def check_logger_names(names: Sequence[str], field: str = "logger") -> list[str]:
    """Return ``names`` without repeats, refusing a logger redline does not have."""
    for name in names:
        if name not in LOGGER_NAMES:
            raise invalid(
                field,
                name,
                "one of " + ", ".join(repr(n) for n in LOGGER_NAMES),
                "csv and jsonl are written by default under --out; tensorboard needs `pip install tensorboard`; "
                "to send the losses elsewhere, a Callback's on_step gets the loss at each logging point and "
                "on_evaluate the metrics",
            )
    return list(dict.fromkeys(names))


def _check_step(step: object, name: str = "step") -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise invalid(name, step, "a non-negative int (the optimizer step)")


def _summary_writer_class() -> type[SummaryWriter]:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ConfigError(
            f"logger='tensorboard' needs the tensorboard package, which is not importable ({exc})\n"
            "hint: pip install tensorboard, or log to csv/jsonl"
        ) from exc
    return SummaryWriter


def _open_tensorboard(
    writer_class: type[SummaryWriter], log_dir: Path, resume_step: int | None, eval_resume_step: int | None
) -> SummaryWriter:
    if resume_step is None:
        # A new run: TensorBoard would draw the old run's event files as part of this one.
        for old in log_dir.glob("events.out.tfevents.*"):
            old.unlink()
        return writer_class(log_dir=str(log_dir))
    # purge_step hides the events the interrupted run wrote at or after it, of every tag (torch SummaryWriter docs):
    # where the resumed run evaluates its first step again, that step's evaluation goes, and its training row (not
    # written again) is put back after the purge
    again = eval_resume_step is not None and eval_resume_step < resume_step
    kept = _training_scalars(log_dir, resume_step) if again else None
    writer = writer_class(log_dir=str(log_dir), purge_step=resume_step if kept is not None else resume_step + 1)
    for tag, value, wall_time in kept or ():
        writer.add_scalar(tag, value, resume_step, walltime=wall_time)
    return writer


def _training_scalars(log_dir: Path, step: int) -> list[tuple[str, float, float]] | None:
    """The training scalars (not val/) the events in ``log_dir`` hold at ``step``: (tag, value, wall time); None
    where they cannot be read (the resumed run's evaluation of ``step`` is then shown twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: every scalar, none sampled away
    tensorboard_log = logging.getLogger("tensorboard")  # it warns of each purge, which is a resume doing its job
    disabled, tensorboard_log.disabled = tensorboard_log.disabled, True
    try:
        events.Reload()
    except Exception as exc:  # a file the tensorboard package cannot parse: the events are left as they are
        log.warning("%s cannot be read (%s): its evaluation at step %d is shown twice", log_dir, exc, step)
        return None
    finally:
        tensorboard_log.disabled = disabled
    tags = [tag for tag in events.Tags().get("scalars", []) if not tag.startswith("val/")]
    at_step = {tag: [event for event in events.Scalars(tag) if event.step == step][-1:] for tag in tags}
    return [(tag, event.value, event.wall_time) for tag, found in at_step.items() for event in found]
