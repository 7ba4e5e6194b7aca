"""Reading a training run's directory back for the report: its summary and its metrics logs.

The Trainer writes them under ``--out`` (train/logs.py, train/output.py): ``metrics.jsonl`` and
``metrics.csv`` hold one row per logged optimizer step, ``eval.jsonl`` and ``eval.csv`` one per
evaluation, and ``summary.json`` the TrainSummary once the run has ended. JSONL is read first: it
keeps every key and writes a diverged loss as NaN where CSV has only text. A run that logged to
TensorBoard alone is read from the scalars of its ``tensorboard/`` events (``val/loss`` as ``val_loss``).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redline.errors import ConfigError, few

log = logging.getLogger("redline")
Row = dict[str, Any]
LOGS = ("metrics.jsonl", "metrics.csv")  # a run's training log, JSONL first
TENSORBOARD = "tensorboard/"  # where a run with --logger tensorboard writes its events, read without the others
EVENTS = "events.out.tfevents.*"
# What a run may write before its first training log: an evaluation (--eval-every below --log-every), the best
# weights it kept, a checkpoint, the tensorboard folder before its first events
BEFORE_FIRST_LOG = {"checkpoints", "eval.jsonl", "eval.csv", "best.safetensors", "best.json", "tensorboard"}
OUT_HINT = "pass the directory a run wrote with --out (`redline train --task SPEC --out DIR`)"


@dataclass(frozen=True)
class RunFiles:
    """What a run directory holds: the summary (None while the run has not ended) and the logged rows.

    ``stale_summary_steps`` is the step count of a summary.json the logs have gone past: the summary of
    an earlier stretch of a run that was resumed and has not ended since (left out as ``summary``).
    ``older_summary`` says a summary.json was left out for being older than the training log: a run ends
    by writing it, so one the log was written after is an earlier run's, in the same --out.
    """

    run_dir: Path
    summary: dict[str, Any] | None
    train: list[Row]  # one row per logged optimizer step, in order
    evals: list[Row]
    train_file: str  # the file names the rows came from, for the report to cite
    eval_file: str | None
    stale_summary_steps: int | None = None
    older_summary: bool = False


def read_run(run_dir: Path) -> RunFiles:
    """Read ``run_dir``'s summary and logs; a missing directory or log, or an unreadable file, is a ConfigError."""
    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "does not exist"
        run = run_above(run_dir) if run_dir.exists() else None  # a file of the run: its summary.json, a log
        hint = _report_the(run) if run is not None else OUT_HINT
        raise ConfigError(f"run directory {str(run_dir)!r} {what}\nhint: {hint}")
    train_file = _first_present(run_dir, LOGS)
    train_file = _newer_csv(run_dir, train_file) if train_file else None
    if _has_events(run_dir) and (train_file is None or _logs_older(run_dir, _newest_events(run_dir))):
        return _read_tensorboard_run(run_dir)
    if train_file is None and (summary := _read_summary(run_dir / "summary.json")):  # a run with no logger at all
        return RunFiles(run_dir=run_dir, summary=summary, train=[], evals=[], train_file="", eval_file=None)
    if train_file is None:
        run = run_above(run_dir)  # given a checkpoint of the run, or its checkpoints folder
        names = {p.name for p in run_dir.iterdir() if not p.name.startswith(".")}
        if run is None and names <= BEFORE_FIRST_LOG:  # a run creates its --out at once, its logs at its first log
            # one killed before it logged is no wrong directory: its evaluations or checkpoints say it is a run
            also = "; one stopped before then logged no step to draw" if names else f"; else {OUT_HINT}"
            raise ConfigError(
                f"{run_dir} holds no metrics yet: a run writes metrics.jsonl and metrics.csv when it first logs "
                f"(after --log-every steps)\nhint: if the run is starting, report it again once it has logged{also}"
            )
        hint = _report_the(run) if run is not None else f"{OUT_HINT}; the default --logger writes both"
        raise ConfigError(
            f"{run_dir} has no metrics.jsonl or metrics.csv: the report draws its curves from them\nhint: {hint}"
        )
    eval_file = _first_present(run_dir, ("eval.jsonl", "eval.csv"))
    eval_file = _newer_csv(run_dir, eval_file) if eval_file else None
    train = _read_rows(run_dir / train_file)
    evals = _read_rows(run_dir / eval_file) if eval_file else []
    return _with_summary(run_dir, train, evals, train_file, eval_file, written=run_dir / train_file)


def _with_summary(
    run_dir: Path, train: list[Row], evals: list[Row], train_file: str, eval_file: str | None, written: Path
) -> RunFiles:
    """The run's files with its summary.json, left out where it is not this run's (``written``: the newest log)."""
    summary = _read_summary(run_dir / "summary.json")
    # A resumed run keeps the summary.json of the stretch it resumed until it ends and writes its own.
    ended_at = summary.get("steps") if summary else None
    stale = isinstance(ended_at, int) and bool(train) and train[-1]["step"] > ended_at
    # One that ended at the last logged step is this run's, whatever the times say: a copy (cp -r, scp, an
    # artifact's download) stamps each file when it arrives.
    ends_the_log = isinstance(ended_at, int) and bool(train) and train[-1]["step"] == ended_at
    older = summary is not None and not stale and not ends_the_log and _older(run_dir / "summary.json", written)
    return RunFiles(
        run_dir=run_dir,
        summary=None if stale or older else summary,
        train=train,
        evals=evals,
        train_file=train_file,
        eval_file=eval_file,
        stale_summary_steps=ended_at if stale else None,
        older_summary=older,
    )


def _has_events(run_dir: Path) -> bool:
    return any((run_dir / TENSORBOARD).glob(EVENTS))


def _logs_older(run_dir: Path, events: Path) -> bool:
    """Whether every log file is older than the events: an earlier run's, left by one with --logger tensorboard
    alone in the same --out (a run that logs to both writes the events with its train or its eval log)."""
    logs = [run_dir / name for name in (*LOGS, "eval.jsonl", "eval.csv") if (run_dir / name).is_file()]
    return all(_older(log, events) for log in logs)


def _newest_events(run_dir: Path) -> Path:
    return max((run_dir / TENSORBOARD).glob(EVENTS), key=lambda path: path.stat().st_mtime)


def _read_tensorboard_run(run_dir: Path) -> RunFiles:
    """A run that logged to TensorBoard alone: its scalars, by step, as the rows its CSV would hold."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ConfigError(
            f"{run_dir} logged to TensorBoard alone (no metrics.jsonl or metrics.csv), and reading its events needs "
            "the tensorboard package, which is not installed\nhint: pip install tensorboard, then report it again"
        ) from None
    folder = run_dir / TENSORBOARD
    # size_guidance 0 keeps every scalar (by default it samples 10,000); the events a resumed run's purge_step
    # hides are dropped by the accumulator, as TensorBoard drops them.
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    tensorboard_log = logging.getLogger("tensorboard")  # it warns of each purge, which is a resume doing its job
    disabled, tensorboard_log.disabled = tensorboard_log.disabled, True
    try:
        events.Reload()
    except Exception as exc:  # a file the tensorboard package cannot parse: say which folder, not its traceback
        raise _unreadable(folder, exc) from exc
    finally:
        tensorboard_log.disabled = disabled
    train: dict[int, Row] = {}
    evals: dict[int, Row] = {}
    for tag in events.Tags().get("scalars", []):
        rows, key = (evals, "val_" + tag.removeprefix("val/")) if tag.startswith("val/") else (train, tag)
        for event in events.Scalars(tag):
            rows.setdefault(int(event.step), {"step": int(event.step)})[key] = float(event.value)
    in_order = [train[step] for step in sorted(train)]
    evals_in_order = [evals[step] for step in sorted(evals)]
    ended = (_read_summary(run_dir / "summary.json") or {}).get("steps")
    if not in_order and isinstance(ended, int) and ended > 0:  # the accumulator skips records it cannot parse
        raise _unreadable(folder, f"its events hold no scalar, though summary.json says the run trained {ended} steps")
    newest = _newest_events(run_dir)
    return _with_summary(run_dir, in_order, evals_in_order, TENSORBOARD, TENSORBOARD if evals else None, newest)


def _report_the(run: Path) -> str:
    return f"{run} holds the run's logs: redline report {run}"


def run_above(path: Path) -> Path | None:
    """The run directory ``path`` lies in (a checkpoint of it, its checkpoints folder, its tensorboard/), or None."""
    parents = path.resolve().parents[:3]
    return next((parent for parent in parents if _first_present(parent, LOGS) or _has_events(parent)), None)


def _first_present(run_dir: Path, names: tuple[str, ...]) -> str | None:
    return next((name for name in names if (run_dir / name).is_file()), None)


def _newer_csv(run_dir: Path, name: str) -> str:
    """The CSV twin of a JSONL log where it was written later: a run with ``--logger csv`` alone in an --out an
    earlier run wrote JSONL in leaves that JSONL as it was. One run writes the CSV, then the JSONL, each log.

    Of the two written alike, the CSV where it starts at an earlier step: a run resumed with the JSONL logger added
    (``--logger csv``, then the default) wrote the JSONL from the resumed step, the CSV from the run's first."""
    twin = name.removesuffix(".jsonl") + ".csv"
    if not name.endswith(".jsonl") or not (run_dir / twin).is_file():
        return name
    if _older(run_dir / name, run_dir / twin):
        return twin
    if _older(run_dir / twin, run_dir / name):
        return name
    try:
        return twin if _span(run_dir / twin) > _span(run_dir / name) else name
    except ConfigError:  # one is damaged: the JSONL is read, and named if it is the one
        return name


def _span(path: Path) -> tuple[float, int]:
    """How much of the run ``path`` logged: from an earlier first step, then in more rows, is more. A run resumed
    with the JSONL logger added (``--logger csv``, then the default) wrote the JSONL from the resumed step; one
    resumed with the CSV alone and then with both has a JSONL with a gap, the stretch the CSV alone logged."""
    rows = _read_rows(path, quiet=True)
    return (-rows[0]["step"] if rows else -math.inf), len(rows)


STALE_S = 2.0  # a file this much older than one its run writes with or before it is an earlier run's


def _older(path: Path, than: Path) -> bool:
    """Whether ``path`` was last written ``STALE_S`` or more before ``than`` (False where either cannot be read)."""
    try:
        return path.stat().st_mtime + STALE_S < than.stat().st_mtime
    except OSError:
        return False


def _read_summary(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None  # written when the run ends: a run still going, or killed, has none yet
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _unreadable(path, exc) from exc
    if not isinstance(data, dict):
        raise _unreadable(path, f"it holds a JSON {type(data).__name__}, not an object")
    if data and not {"task", "steps"} & data.keys():  # another tool's JSON there (a trace): not the run's summary
        raise _unreadable(path, f"it is not a run's summary: no task or steps in it (its keys: {few(list(data), 4)})")
    return data


def _read_rows(path: Path, *, quiet: bool = False) -> list[Row]:
    """The file's rows, each with an int "step"; a last row a killed run left half-written (without its end) is
    skipped, and so are rows damaged in the middle (named in a warning, unless ``quiet``), where any row reads."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise _unreadable(path, exc) from exc
    # The logger writes whole lines: one left without its end is the row a killed run was writing. In CSV
    # it can still parse, its last figure cut short ("655" of "655.38") and the cells after it empty.
    text = text[: text.rfind("\n") + 1]
    if path.suffix == ".jsonl":
        lines: list[tuple[str, Any]] = [(f"line {n}", line) for n, line in enumerate(text.splitlines(), start=1)]
        parse = _json_row
    else:
        reader, lines, end = csv.DictReader(io.StringIO(text)), [], 1
        for line in reader:  # a quoted cell spans lines: a stray quote takes in the rows after it
            start, end = end + 1, reader.line_num
            lines.append((f"line {start}" if start == end else f"lines {start}-{end}", line))
        parse = _csv_row
    rows, damaged = [], []
    for where, line in lines:  # each one whole: a row that does not parse is damage, not a cut
        try:
            rows.append(parse(line))
        except (TypeError, ValueError, KeyError) as exc:
            why = f"it has no {exc}" if isinstance(exc, KeyError) else str(exc)
            damaged.append(f"{where}: {why if len(why) <= 80 else why[:77] + '...'}")
    if damaged and not rows:
        raise _unreadable(path, damaged[0])
    if damaged and not quiet:
        log.warning(
            "%s: %d damaged row(s) left out, which do not parse (%s); the curves go on without them", path,
            len(damaged), few(damaged, 2),
        )  # fmt: skip
    return rows


def _json_row(line: Any) -> Row:
    row = json.loads(line)
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {line!r}")
    return _with_step(row)


def _csv_row(line: Any) -> Row:
    row: Row = {key: _number(value) for key, value in line.items() if key is not None}
    return _with_step(row)


def _number(text: str | None) -> float | None:
    """A CSV cell as a number; an empty cell (a figure not measured) as None."""
    if text is None or text == "":
        return None
    return float(text)


def _with_step(row: Row) -> Row:
    step = row["step"]
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"step={step!r} is not an int")
    row["step"] = step
    return row


def values(rows: list[Row], key: str) -> list[float | None]:
    """Each row's ``key`` as a float, None where a row lacks it or holds no number (NaN stays NaN)."""
    out: list[float | None] = []
    for row in rows:
        value = row.get(key)
        out.append(float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None)
    return out


def has_values(rows: list[Row], key: str) -> bool:
    """Whether any row holds a finite number under ``key``."""
    return any(value is not None and math.isfinite(value) for value in values(rows, key))


def not_finite(rows: list[Row], key: str, what: str, name: str, meaning: str) -> str:
    """A note naming the logged steps whose ``key`` (``what``, from file ``name``) is NaN or infinite, and what that
    means (``meaning``), or "": a gap the curve cannot show where it is the end."""
    bad = [
        row["step"] for row, v in zip(rows, values(rows, key), strict=True) if v is not None and not math.isfinite(v)
    ]
    if not bad:
        return ""
    told = "every logged step" if len(bad) == len(rows) else f"{len(bad)} of {len(rows)} logged steps"
    return (
        f"The {what} in {name} is not finite (NaN or inf) at {told}, the first at step {bad[0]}: the curve leaves "
        f"them out, and {meaning}."
    )


def ends_not_finite(rows: list[Row], key: str) -> bool:
    """Whether the last row's ``key`` is NaN or infinite."""
    last = values(rows[-1:], key)
    return bool(last) and last[0] is not None and not math.isfinite(last[0])


# What the report does without each file, for the hint of one it cannot read.
_WITHOUT = {
    "summary.json": ", or delete it: the report then draws the run from its logs, as one that has not ended",
    "metrics.jsonl": ", or delete it: the report then reads metrics.csv in its place, if the run wrote one",
    "eval.jsonl": ", or delete it: the report then reads eval.csv in its place, if the run wrote one",
    "eval.csv": ", or delete it: the report then draws no validation curve",
}


def _unreadable(path: Path, why: object) -> ConfigError:
    without = _WITHOUT.get(path.name, ": the report draws its curves from it")
    return ConfigError(f"{path} cannot be read: {why}\nhint: restore {path.name} from the run{without}")
