"""Results as one self-contained HTML page: a bench result or a training run, with charts.

The page loads nothing (render/page.py: inline style, charts as ``data:`` PNGs, no script), so it reads the
same offline, attached to an issue, or years later. Every string that comes from a result is escaped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from redline.atomic import make_parent, write_atomic
from redline.errors import ConfigError, invalid
from redline.render import run_files
from redline.render.bench import (
    CACHED_TOLD,
    DIVERGED,
    ISOLATED_MEMORY,
    TF32_TOLD,
    TRIAL_CACHED_TOLD,
    diverged,
    percent,
    precision_label,
    repaid_after,
    shown_name,
    steps_told,
)
from redline.render.page import figure, figure_text, finite, page, paragraph, plan_table, table
from redline.render.page_path import page_target, refuse_replacing
from redline.render.plots import Chart, Series, bar_chart, line_chart, require_matplotlib
from redline.render.run_files import LOGS, RunFiles, has_values, read_run, run_above, values

GIB = 2**30
KIND_COLORS = {"naive": "#9aa0a6", "explicit": "#4c78a8", "auto": "#f58518"}
KIND_LEGEND = "Grey: the naive loop; blue: a configuration set by hand; orange: auto (redline's Plan)."


def bench_report(result: Mapping[str, Any] | Any) -> str:
    """Return a bench result (what ``redline.benchmark`` returns, or its ``to_dict()``: the bench command's JSON data)
    as one self-contained HTML document.

    Charts show the rows without an error; every row, failed ones included, is in the table.
    """
    if not isinstance(result, Mapping):
        if not callable(getattr(result, "to_dict", None)):
            raise invalid(
                "result", type(result).__name__, "a BenchResult or its to_dict()", "pass what benchmark returns"
            )
        result = result.to_dict()
    require_matplotlib()
    rows = list(result.get("rows") or [])
    ok = [row for row in rows if not row.get("error")]
    title = f"redline bench: {result.get('task', '?')}"
    if result.get("measured_at"):
        title += f", {result['measured_at']}"
    sub = f"{len(rows)} configuration(s) of the same task, side by side in one run"
    if result.get("steps") is not None:
        sub += f"; {steps_told({'window': '?', **result})}"
    body = [paragraph("lead", _best_line(ok, failed=len(rows) - len(ok))), "<h2>Machine</h2>", _machine(result)]
    body += ["<h2>Throughput and speed-up</h2>", *_bench_charts(ok, isolated=bool(result.get("isolated")))]
    body += ["<h2>Every configuration</h2>", *_rows_table(rows), *_failures(rows)]
    planned = [row for row in rows if row.get("plan")]
    if planned:
        body.append("<h2>Plans</h2>")
        for row in planned:
            body += [f"<h3>{escape(str(row.get('name', '?')))}</h3>", plan_table(row["plan"])]
    return page(title, sub, body)


def run_report(run_dir: str | os.PathLike[str]) -> str:
    """Return a training run directory (``--out``) as one self-contained HTML document.

    Raises ConfigError when the directory, or a metrics log in it, is missing or unreadable.
    A run without summary.json (still running, or killed) is drawn from its logs alone.
    """
    run_dir = Path(run_dir)
    files = read_run(run_dir)
    require_matplotlib()
    summary = files.summary
    named = run_dir.resolve().name  # "." (a report of the directory it is run in) names the directory
    task = str(summary.get("task", named)) if summary else named
    if summary:
        sub = f"{run_dir}: {summary.get('steps', '?')} steps on {summary.get('device', '?')} "
        sub += f"(stopped: {summary.get('stopped', '?')})"
    elif files.stale_summary_steps is not None:
        sub = f"{run_dir}: summary.json ends at step {files.stale_summary_steps} but the logs go on past it, so the "
        sub += "run was resumed and is still going or was stopped before it ended"
    elif files.older_summary:
        sub = f"{run_dir}: summary.json is older than {files.train_file} (an earlier run's, or the stretch before "
        sub += "a resume), so this run is still going or was stopped before it ended"
    elif files.train and run_files.ends_not_finite(files.train, "loss"):  # a diverged run stops there, unsummed
        sub = f"{run_dir}: no summary.json: the run stopped at step {files.train[-1]['step']}, where its loss was not "
        sub += "finite (a run stopped by a NaN or inf loss writes no summary)"
    else:
        sub = f"{run_dir}: no summary.json yet, so the run is still going or was stopped before it ended"
    body = [paragraph("lead", _run_line(files)), *_run_charts(files)]
    if summary:
        body += ["<h2>Summary</h2>", _summary_table(summary, files.evals)]
        if summary.get("sample"):
            body += ["<h3>Sample</h3>", f"<pre>{escape(str(summary['sample']))}</pre>"]
        if summary.get("plan"):
            body += ["<h2>Plan</h2>", plan_table(summary["plan"])]
    sources = " and ".join(dict.fromkeys(n for n in (files.train_file, files.eval_file) if n)) or "summary.json"
    return page(f"redline run: {task}", sub, body, footer=f"Read from {sources} in {run_dir}.")


def write_report(path: str | os.PathLike[str], html: str) -> Path:
    """Write ``html`` to ``path`` atomically (a crash leaves the old file or the new one) and return the path.

    A missing directory is created. A file there that is no page (not .html), or a page redline did not make, is
    refused (ConfigError), as ``redline bench --html`` and ``report`` refuse it: the page would replace it.
    """
    target = Path(path)
    refuse_replacing(target, told=repr(str(target)), flag="")

    def write(tmp: Path) -> None:  # a path that is not UTF-8 (a run directory's, shown) carries lone surrogates
        tmp.write_text(html, encoding="utf-8", errors="replace")

    try:
        make_parent(target)
        write_atomic(target, write)
    except OSError as exc:
        why = f"{exc.filename} is a file, not a directory" if isinstance(exc, NotADirectoryError) else exc.strerror
        raise ConfigError(
            f"the report cannot be written to {str(target)!r} ({why or exc})\n"
            "hint: write it to a file in a directory you can write to (--html FILE)"
        ) from exc
    return target


def report(run_dir: str | os.PathLike[str], path: str | os.PathLike[str] | None = None) -> Path:
    """Write the HTML report of a training run directory and return where it went (default RUN_DIR/report.html).

    Given a bench result saved as JSON (``redline bench --json > FILE.json``), write its page instead
    (default FILE.html beside it): a bench need not run again for its report.
    """
    run_dir = Path(run_dir)
    if run_dir.suffix.lower() == ".json" and not run_dir.exists():  # not "run directory ... does not exist"
        raise ConfigError(f"{str(run_dir)!r} does not exist\nhint: {BENCH_HINT}")
    if _is_bench_file(run_dir):
        html = bench_report(_read_bench(run_dir))
        return write_report(page_target(path, run_dir.with_suffix(".html"), [run_dir]), html)
    html = run_report(run_dir)
    sources = [run_dir / name for name in (*LOGS, "eval.jsonl", "eval.csv", "summary.json")]
    return write_report(page_target(path, run_dir / "report.html", sources), html)


def _is_bench_file(path: Path) -> bool:
    """Whether ``path`` is given as a bench result: a JSON file other than a run's summary, or any file that does
    not lie in a run (``redline bench --json > bench.out``); a run's own file is told to name its run instead."""
    if not path.is_file() or path.name == "summary.json":
        return False
    return path.suffix.lower() == ".json" or run_above(path) is None


def _read_bench(path: Path) -> Mapping[str, Any]:
    """A bench result saved with ``redline bench --json``; anything else is a ConfigError naming the file."""
    hint = f"hint: {BENCH_HINT}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read as a bench result: {exc}\n{hint}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ConfigError(f"{path} is not a bench result: it has no list of rows\n{hint}")
    odd = next((i for i, row in enumerate(data["rows"]) if not isinstance(row, dict)), None)
    if odd is not None:
        raise ConfigError(f"{path} is not a bench result: its row {odd + 1} is not an object\n{hint}")
    return data


# A validation loss that is not finite, where training may be sound
VAL_NOT_FINITE = (
    "where the train loss stays finite, the model is sound: check val_data for NaN, and loss_fn on its batches "
    "(one whose every target is ignored weighs nothing: NaN)"
)
NO_METRICS = "No metrics file was found (a run with no logger writes none)"
BENCH_HINT = "pass the file `redline bench --json > FILE.json` wrote, or the directory a run wrote with --out"


# Bench


def _best_line(ok: Sequence[Mapping[str, Any]], failed: int) -> str:
    """The fastest configuration of each batch size, as the terminal's best line names them: a larger batch's
    samples/s is no like-for-like win over a smaller one's."""
    failures = f" {failed} configuration(s) failed: see the table." if failed else ""
    measured = [row for row in ok if finite(row.get("samples_per_s")) is not None]
    if not measured:
        return escape("No configuration completed, so there is nothing to compare." + failures)
    sizes = list(dict.fromkeys(row.get("batch_size") for row in measured))
    best = [_best_of([r for r in measured if r.get("batch_size") == size], size, len(sizes) > 1) for size in sizes]
    return " ".join(best) + escape(failures)


def _best_of(rows: Sequence[Mapping[str, Any]], size: object, named: bool) -> str:
    """The fastest of one batch size's rows that kept a finite loss (``named``: "at batch N")."""
    at = f" at batch {size}" if named else ""
    if all(diverged(row) for row in rows):
        return escape(f"No configuration{at} kept a finite loss: {DIVERGED}.")
    best = max((row for row in rows if not diverged(row)), key=lambda row: row["samples_per_s"])
    speedup = finite(best.get("speedup_naive"))
    versus = f", {speedup:.2f}x the naive loop" if speedup is not None else ""
    return (
        f"Best configuration{escape(at)}: <strong>{escape(shown_name(best) if 'name' in best else '?')}</strong>"
        f"{escape(versus)} ({escape(figure_text('samples_per_s', best['samples_per_s']))} samples/s)."
    )


def _machine(result: Mapping[str, Any]) -> str:
    machine = dict(result.get("machine") or {})
    versions = {f"{name} version": value for name, value in (result.get("versions") or {}).items()}
    pairs = [(key, figure_text(key, value)) for key, value in {**machine, **versions}.items()]
    return table(None, [[f"<strong>{escape(k)}</strong>", escape(v)] for k, v in pairs])


def _bench_charts(ok: Sequence[Mapping[str, Any]], *, isolated: bool) -> list[str]:
    if not ok:
        return [paragraph("note", "No chart: no configuration completed.")]
    out = []
    for key, title, unit in (
        ("samples_per_s", "Throughput", "samples/s"),
        ("tokens_per_s", "Token throughput", "tokens/s"),
    ):
        chart = _bars(ok, key, title=title, xlabel=f"{unit} (median over windows; higher is faster)")
        if chart is not None:
            out.append(figure(chart, KIND_LEGEND))
        elif key == "samples_per_s":
            out.append(paragraph("note", "No configuration measured samples/s."))
    speedup = _bars(ok, "speedup_naive", title="Speed-up over the naive loop", xlabel="x the naive loop's samples/s",
                    reference=1.0)  # fmt: skip
    if speedup is not None:
        out.append(figure(speedup, "The dashed line is the naive loop (1.0x); a bar past it is faster."))
    mfu = _bars(ok, "mfu", title="Model FLOP utilisation (MFU)", xlabel="% of the device's peak FLOP/s")
    if mfu is not None:
        out.append(figure(mfu, "Rows whose device has no known peak FLOP/s are left out."))
    else:
        none = "MFU: not available for any configuration (a CPU, or a GPU without a known peak)."
        out.append(paragraph("note", none))
    resident = all(row.get("peak_mem_kind") == "resident" for row in ok)  # a CPU's: the process's
    held = ISOLATED_MEMORY if isolated else "it only grows, row by row"  # one process: each row's peak holds the last's
    at = f"the process held at its peak (on a CPU: {held})" if resident else "at a step's peak"
    memory = _bars(ok, "peak_mem_bytes", title="Peak memory", xlabel=f"GiB {at}")
    out.append(figure(memory, KIND_LEGEND) if memory else paragraph("note", "Peak memory: not measured."))
    return out


def _bars(
    rows: Sequence[Mapping[str, Any]],
    key: str,
    *,
    title: str,
    xlabel: str,
    reference: float | None = None,
) -> Chart | None:
    """Bars of ``key`` for the rows that have it; None when none has."""
    have = [(row, value) for row in rows if (value := finite(row.get(key))) is not None]
    if not have:
        return None
    scale = {"peak_mem_bytes": 1 / GIB, "mfu": 100.0}.get(key, 1.0)  # bars drawn in GiB and in percent
    return bar_chart(
        [str(row.get("name", "?")) for row, _ in have],
        [value * scale for _, value in have],
        title=title,
        xlabel=xlabel,
        value_text=lambda v: figure_text(key, v / scale),
        colors=[KIND_COLORS.get(str(row.get("kind")), KIND_COLORS["explicit"]) for row, _ in have],
        reference=reference,
    )


def _rows_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every row with every figure; a compile the on-disk caches served, or a trial redline's cache did, says so in
    its cell, and a note why; an fp32 row whose matmuls ran in TF32 says that too."""
    hidden = ("plan", "error", "compile_cached", "trial_cached")
    columns = list(dict.fromkeys(k for row in rows for k in row if k not in hidden))
    columns.append("error")
    cells = []
    for row in rows:
        said = {**row, "loss": "not finite"} if diverged(row) else dict(row)
        said["precision"] = precision_label(row)
        if row.get("compile_s") is not None:  # "never" repaid, told apart from no eager row to compare with
            said["break_even_steps"] = repaid_after(row, rows)
        for key in ("compile", "trial"):
            if row.get(f"{key}_s") is not None and row.get(f"{key}_cached"):
                said[f"{key}_s"] = f"{figure_text(f'{key}_s', row[f'{key}_s'])} (cached)"
        cells.append([escape(figure_text(key, said.get(key))) for key in columns])
    classes = ["failed" if row.get("error") else "" for row in rows]
    numeric = {i for i, key in enumerate(columns) if any(finite(row.get(key)) is not None for row in rows)}
    shown = f'<div class="wide">{table(columns, cells, numeric=numeric, row_classes=classes)}</div>'
    notes = [f"compile_s (cached): {CACHED_TOLD}."] if any(row.get("compile_cached") for row in rows) else []
    if any(row.get("trial_s") is not None and row.get("trial_cached") for row in rows):
        notes.append(f"trial_s (cached): {TRIAL_CACHED_TOLD}.")
    if any(precision_label(row) != row.get("precision") for row in rows):
        notes.append(f"fp32 (TF32): {TF32_TOLD}.")
    return [shown, *(paragraph("note", escape(note)) for note in notes)]


def _failures(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The failed rows with their errors in full (the table's last column may be out of view)."""
    items = [
        f"<li><strong>{escape(str(row.get('name', '?')))}</strong> failed: {escape(str(row['error']))}</li>"
        for row in rows
        if row.get("error")
    ]
    return [f'<ul class="failures">{"".join(items)}</ul>'] if items else []


# Run


def _run_line(files: RunFiles) -> str:
    summary = files.summary or {}
    last = files.train[-1] if files.train else {}
    steps = summary.get("steps", last.get("step"))
    parts = [f"{steps} step{'' if steps == 1 else 's'}" if steps is not None else "no step logged"]
    if finite(summary.get("final_loss")) is not None:  # not the last point of the loss chart: say what it is
        parts.append(f"final loss {summary['final_loss']:.4g} (mean of the last steps)")
    for key, label in (("val_loss", "val loss"), ("val_metric", "val metric")):
        if finite(summary.get(key)) is not None:
            parts.append(f"{label} {summary[key]:.4g}")
        elif run_files.ends_not_finite(files.evals, key):  # summary.json stores a NaN as null; the eval log keeps it
            parts.append(f"{label} not finite")
    for key, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")):
        if finite(summary.get(key)) is not None:
            parts.append(f"{figure_text(key, summary[key])} {unit}")
    if finite(summary.get("mfu")) is not None:
        parts.append(f"MFU {percent(summary['mfu'], 1)}")
    if isinstance(summary.get("resumed_from"), str) and finite(summary.get("samples_per_s")) is not None:
        parts.append(f"the rates since the resume from {Path(summary['resumed_from']).name}")  # its process timed them
    return escape(", ".join(parts) + ".")


def _run_charts(files: RunFiles) -> list[str]:
    train, evals = files.train, files.evals
    steps = [float(row["step"]) for row in train]
    if not train:  # no log: the run's summary alone, of a run with no logger (loggers=()) or a log removed since
        said = f"{files.train_file} holds no step yet" if files.train_file else NO_METRICS
        return [paragraph("note", f"{said}, so there is no curve to draw.")]
    out = []
    loss = [Series("train loss", steps, values(train, "loss"))]
    if has_values(evals, "val_loss"):
        loss.append(Series("val loss", [float(r["step"]) for r in evals], values(evals, "val_loss"), points=True))
    if has_values(train, "loss") or len(loss) > 1:
        out.append(figure(line_chart(loss, title="Loss", ylabel="loss", log_y=True)))
    notes = [run_files.not_finite(train, "loss", "train loss", files.train_file, "the run diverged there")]
    notes.append(run_files.not_finite(evals, "val_loss", "validation loss", files.eval_file or "", VAL_NOT_FINITE))
    gaps = [paragraph("note", note) for note in notes if note]
    if not gaps and not has_values(train, "loss"):  # a log without the key: what it lacks, as for the charts below
        gaps = [paragraph("note", f"Loss: {files.train_file} holds no loss value.")]
    out += gaps
    for key, title, ylabel in (
        ("samples_per_s", "Throughput", "samples/s"),
        ("tokens_per_s", "Token throughput", "tokens/s"),
        ("mem_gib", "Memory", "GiB (peak of each log window)"),
        ("step_time_ms", "Step time", "ms per optimizer step"),
    ):
        if has_values(train, key):
            out.append(figure(line_chart([Series(ylabel, steps, values(train, key))], title=title, ylabel=ylabel)))
        elif key != "tokens_per_s":  # a task without tokens has no token rate to miss
            out.append(paragraph("note", f"{title}: {files.train_file} holds no {key} value."))
    return out


def _summary_table(summary: Mapping[str, Any], evals: list[dict[str, Any]]) -> str:
    for key in ("val_loss", "val_metric"):
        if summary.get(key) is None and run_files.ends_not_finite(evals, key):  # a NaN is stored as null
            summary = {**summary, key: "not finite"}
    pairs = [(key, value) for key, value in summary.items() if key not in ("plan", "sample")]
    return table(None, [[f"<strong>{escape(k)}</strong>", escape(figure_text(k, v))] for k, v in pairs])
