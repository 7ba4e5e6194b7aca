"""Results as one self-contained HTML page: a bench result or a training run, with charts.

The page loads nothing: its style is inline, its charts are PNGs inside ``data:`` URLs, it has no
script, and its Content-Security-Policy forbids anything else, so it reads the same offline, attached
to an issue, or years later. Every string that comes from a result is escaped.
"""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from redline.atomic import make_parent, write_atomic
from redline.errors import ConfigError, invalid
from redline.render import run_files
from redline.render.bench import (
    CACHED_TOLD,
    DIVERGED,
    TF32_TOLD,
    TRIAL_CACHED_TOLD,
    diverged,
    percent,
    precision_label,
    repaid_after,
    shown_name,
    steps_told,
)
from redline.render.memory import size as size_text
from redline.render.page_path import MADE_BY, page_target, refuse_replacing
from redline.render.plots import Chart, Series, bar_chart, line_chart, number_text, require_matplotlib
from redline.render.run_files import LOGS, RunFiles, has_values, read_run, run_above, values
from redline.version import __version__

GIB = 2**30
KIND_COLORS = {"naive": "#9aa0a6", "explicit": "#4c78a8", "auto": "#f58518"}
KIND_LEGEND = "Grey: the naive loop; blue: a configuration set by hand; orange: auto (redline's Plan)."
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222; background: #fff;
       max-width: 60rem; margin: 2rem auto; padding: 0 1rem; }
h1 { font-size: 1.6rem; margin: 0 0 .2rem; }
h2 { font-size: 1.2rem; margin: 2rem 0 .6rem; border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
h3 { font-size: 1rem; margin: 1.2rem 0 .4rem; }
.sub { color: #666; margin: 0 0 1rem; }
.lead { font-size: 1.1rem; background: #f4f7fb; border-left: 4px solid #4c78a8; padding: .6rem .9rem; }
.note { color: #555; font-style: italic; }
figure { margin: 1rem 0 1.6rem; }
figure img { max-width: 100%; height: auto; display: block; }
figcaption { color: #666; font-size: .85rem; }
.wide { overflow-x: auto; }
.wide td { white-space: nowrap; }
.wide td:last-child { white-space: normal; min-width: 16rem; }
table { border-collapse: collapse; font-size: .85rem; margin: .4rem 0 1rem; }
th, td { border: 1px solid #ddd; padding: .25rem .5rem; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr:nth-child(even) td { background: #fafafa; }
tr.failed td { background: #fdecea; }
.failures li { color: #a4262c; }
pre { background: #f6f6f6; padding: .6rem; overflow-x: auto; white-space: pre-wrap; }
footer { color: #888; font-size: .8rem; margin-top: 2.5rem; }
"""


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
    body = [_p("lead", _best_line(ok, failed=len(rows) - len(ok))), "<h2>Machine</h2>", _machine(result)]
    body += ["<h2>Throughput and speed-up</h2>", *_bench_charts(ok)]
    body += ["<h2>Every configuration</h2>", *_rows_table(rows), *_failures(rows)]
    planned = [row for row in rows if row.get("plan")]
    if planned:
        body.append("<h2>Plans</h2>")
        for row in planned:
            body += [f"<h3>{escape(str(row.get('name', '?')))}</h3>", plan_table(row["plan"])]
    return _page(title, sub, body)


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
    else:
        sub = f"{run_dir}: no summary.json yet, so the run is still going or was stopped before it ended"
    body = [_p("lead", _run_line(files)), *_run_charts(files)]
    if summary:
        body += ["<h2>Summary</h2>", _summary_table(summary, files.evals)]
        if summary.get("sample"):
            body += ["<h3>Sample</h3>", f"<pre>{escape(str(summary['sample']))}</pre>"]
        if summary.get("plan"):
            body += ["<h2>Plan</h2>", plan_table(summary["plan"])]
    sources = " and ".join(dict.fromkeys(n for n in (files.train_file, files.eval_file) if n)) or "summary.json"
    return _page(f"redline run: {task}", sub, body, footer=f"Read from {sources} in {run_dir}.")


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
BENCH_HINT = "pass the file `redline bench --json > FILE.json` wrote, or the directory a run wrote with --out"


def plan_table(plan: object) -> str:
    """Return a Plan's data (``{axis: {"value", "reason"}}``) as an HTML table: axis, value, why; anything else
    (a file edited by hand, another tool's) as its JSON text."""
    if not isinstance(plan, Mapping):
        return f"<pre>{escape(json.dumps(plan))}</pre>"
    rows = []
    for axis, choice in plan.items():
        value, reason = (choice.get("value"), choice.get("reason", "")) if isinstance(choice, Mapping) else (choice, "")
        rows.append([escape(str(axis)), escape(_plan_value(value)), escape(str(reason))])
    return _table(["axis", "value", "why"], rows)


# Bench


def _best_line(ok: Sequence[Mapping[str, Any]], failed: int) -> str:
    failures = f" {failed} configuration(s) failed: see the table." if failed else ""
    measured = [row for row in ok if _number(row.get("samples_per_s")) is not None]
    if not measured:
        return escape("No configuration completed, so there is nothing to compare." + failures)
    if all(diverged(row) for row in measured):
        return escape(f"No configuration kept a finite loss: {DIVERGED}.{failures}")
    best = max((row for row in measured if not diverged(row)), key=lambda row: row["samples_per_s"])
    speedup = _number(best.get("speedup_naive"))
    versus = f", {speedup:.2f}x the naive loop" if speedup is not None else ""
    return (
        f"Best configuration: <strong>{escape(shown_name(best) if 'name' in best else '?')}</strong>{escape(versus)} "
        f"({escape(_format('samples_per_s', best['samples_per_s']))} samples/s).{escape(failures)}"
    )


def _machine(result: Mapping[str, Any]) -> str:
    machine = dict(result.get("machine") or {})
    versions = {f"{name} version": value for name, value in (result.get("versions") or {}).items()}
    pairs = [(key, _format(key, value)) for key, value in {**machine, **versions}.items()]
    return _table(None, [[f"<strong>{escape(k)}</strong>", escape(v)] for k, v in pairs])


def _bench_charts(ok: Sequence[Mapping[str, Any]]) -> list[str]:
    if not ok:
        return [_p("note", "No chart: no configuration completed.")]
    out = []
    for key, title, unit in (
        ("samples_per_s", "Throughput", "samples/s"),
        ("tokens_per_s", "Token throughput", "tokens/s"),
    ):
        chart = _bars(ok, key, title=title, xlabel=f"{unit} (median over windows; higher is faster)")
        if chart is not None:
            out.append(_figure(chart, KIND_LEGEND))
        elif key == "samples_per_s":
            out.append(_p("note", "No configuration measured samples/s."))
    speedup = _bars(ok, "speedup_naive", title="Speed-up over the naive loop", reference=1.0,
                    xlabel="x the naive loop, timed side by side in the same rounds")  # fmt: skip
    if speedup is not None:
        out.append(_figure(speedup, "The dashed line is the naive loop (1.0x); a bar past it is faster."))
    mfu = _bars(ok, "mfu", title="Model FLOP utilisation (MFU)", xlabel="% of the device's peak FLOP/s")
    if mfu is not None:
        out.append(_figure(mfu, "Rows whose device has no known peak FLOP/s are left out."))
    else:
        out.append(_p("note", "MFU: not available for any configuration (a CPU, or a GPU without a known peak)."))
    resident = all(row.get("peak_mem_kind") == "resident" for row in ok)  # a CPU's: the process's, growing by row
    at = "the process held at its peak (on a CPU: it only grows, row by row)" if resident else "at a step's peak"
    memory = _bars(ok, "peak_mem_bytes", title="Peak memory", xlabel=f"GiB {at}")
    out.append(_figure(memory, KIND_LEGEND) if memory else _p("note", "Peak memory: not measured."))
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
    have = [(row, value) for row in rows if (value := _number(row.get(key))) is not None]
    if not have:
        return None
    scale = {"peak_mem_bytes": 1 / GIB, "mfu": 100.0}.get(key, 1.0)  # bars drawn in GiB and in percent
    return bar_chart(
        [str(row.get("name", "?")) for row, _ in have],
        [value * scale for _, value in have],
        title=title,
        xlabel=xlabel,
        value_text=lambda v: _format(key, v / scale),
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
                said[f"{key}_s"] = f"{_format(f'{key}_s', row[f'{key}_s'])} (cached)"
        cells.append([escape(_format(key, said.get(key))) for key in columns])
    classes = ["failed" if row.get("error") else "" for row in rows]
    numeric = {i for i, key in enumerate(columns) if any(_number(row.get(key)) is not None for row in rows)}
    table = f'<div class="wide">{_table(columns, cells, numeric=numeric, row_classes=classes)}</div>'
    notes = [f"compile_s (cached): {CACHED_TOLD}."] if any(row.get("compile_cached") for row in rows) else []
    if any(row.get("trial_s") is not None and row.get("trial_cached") for row in rows):
        notes.append(f"trial_s (cached): {TRIAL_CACHED_TOLD}.")
    if any(precision_label(row) != row.get("precision") for row in rows):
        notes.append(f"fp32 (TF32): {TF32_TOLD}.")
    return [table, *(_p("note", escape(note)) for note in notes)]


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
    if _number(summary.get("final_loss")) is not None:  # not the last point of the loss chart: say what it is
        parts.append(f"final loss {summary['final_loss']:.4g} (mean of the last steps)")
    for key, label in (("val_loss", "val loss"), ("val_metric", "val metric")):
        if _number(summary.get(key)) is not None:
            parts.append(f"{label} {summary[key]:.4g}")
        elif run_files.ends_not_finite(files.evals, key):  # summary.json stores a NaN as null; the eval log keeps it
            parts.append(f"{label} not finite")
    for key, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")):
        if _number(summary.get(key)) is not None:
            parts.append(f"{_format(key, summary[key])} {unit}")
    if _number(summary.get("mfu")) is not None:
        parts.append(f"MFU {percent(summary['mfu'], 1)}")
    if isinstance(summary.get("resumed_from"), str) and _number(summary.get("samples_per_s")) is not None:
        parts.append(f"the rates since the resume from {Path(summary['resumed_from']).name}")  # its process timed them
    return escape(", ".join(parts) + ".")


def _run_charts(files: RunFiles) -> list[str]:
    train, evals = files.train, files.evals
    steps = [float(row["step"]) for row in train]
    if not train:  # no log named: the run's summary alone, a run with no logger (loggers=())
        said = f"{files.train_file} holds no step yet" if files.train_file else "The run logged no metrics (no logger)"
        return [_p("note", f"{said}, so there is no curve to draw.")]
    out = []
    loss = [Series("train loss", steps, values(train, "loss"))]
    if has_values(evals, "val_loss"):
        loss.append(Series("val loss", [float(r["step"]) for r in evals], values(evals, "val_loss"), points=True))
    if has_values(train, "loss") or len(loss) > 1:
        out.append(_figure(line_chart(loss, title="Loss", ylabel="loss", log_y=True)))
    notes = [run_files.not_finite(train, "loss", "train loss", files.train_file, "the run diverged there")]
    notes.append(run_files.not_finite(evals, "val_loss", "validation loss", files.eval_file or "", VAL_NOT_FINITE))
    gaps = [_p("note", note) for note in notes if note]
    if not gaps and not has_values(train, "loss"):  # a log without the key: what it lacks, as for the charts below
        gaps = [_p("note", f"Loss: {files.train_file} holds no loss value.")]
    out += gaps
    for key, title, ylabel in (
        ("samples_per_s", "Throughput", "samples/s"),
        ("tokens_per_s", "Token throughput", "tokens/s"),
        ("mem_gib", "Memory", "GiB (peak of each log window)"),
        ("step_time_ms", "Step time", "ms per optimizer step"),
    ):
        if has_values(train, key):
            out.append(_figure(line_chart([Series(ylabel, steps, values(train, key))], title=title, ylabel=ylabel)))
        elif key != "tokens_per_s":  # a task without tokens has no token rate to miss
            out.append(_p("note", f"{title}: {files.train_file} holds no {key} value."))
    return out


def _summary_table(summary: Mapping[str, Any], evals: list[dict[str, Any]]) -> str:
    for key in ("val_loss", "val_metric"):
        if summary.get(key) is None and run_files.ends_not_finite(evals, key):  # a NaN is stored as null
            summary = {**summary, key: "not finite"}
    pairs = [(key, value) for key, value in summary.items() if key not in ("plan", "sample")]
    return _table(None, [[f"<strong>{escape(k)}</strong>", escape(_format(k, v))] for k, v in pairs])


# Page


def _page(title: str, subtitle: str, body: Iterable[str], footer: str = "") -> str:
    made = f"{MADE_BY} {__version__}. {footer}".strip()
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            '<link rel="icon" href="data:,">',  # a browser asks for /favicon.ico otherwise
            f"<title>{escape(title)}</title>",
            f"<style>{CSS}</style>",
            "</head>",
            "<body>",
            f"<h1>{escape(title)}</h1>",
            _p("sub", escape(subtitle)),
            *body,
            f"<footer>{escape(made)}</footer>",
            "</body>",
            "</html>",
            "",
        ]
    )


def _p(css_class: str, inner_html: str) -> str:
    return f'<p class="{css_class}">{inner_html}</p>'


def _figure(chart: Chart, caption: str = "") -> str:
    data = base64.b64encode(chart.png).decode("ascii")
    img = (
        f'<img src="data:image/png;base64,{data}" alt="{escape(chart.alt)}" '
        f'width="{chart.width_px}" height="{chart.height_px}">'
    )
    return f"<figure>{img}<figcaption>{escape(caption)}</figcaption></figure>" if caption else f"<figure>{img}</figure>"


def _table(
    headers: Sequence[str] | None,
    rows: Sequence[Sequence[str]],
    *,
    numeric: set[int] | None = None,
    row_classes: Sequence[str] | None = None,
) -> str:
    """An HTML table of cells that are already HTML (escaped by the caller); headers are escaped here."""
    numeric = numeric or set()
    head = "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in headers) + "</tr>" if headers else ""
    lines = []
    for index, cells in enumerate(rows):
        css = row_classes[index] if row_classes else ""
        tds = "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(cells))
        lines.append(f'<tr class="{css}">{tds}</tr>' if css else f"<tr>{tds}</tr>")
    return f"<table>{head}{''.join(lines)}</table>"


def _number(value: object) -> float | None:
    """``value`` as a float when it is a finite number (not a bool); None otherwise: a JSON's NaN or Infinity
    (Python's json writes them) is no figure to chart."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _plan_value(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def _format(key: str, value: object) -> str:
    """A figure as a person reads it: units from the key's name, thousands separated, None as a dash."""
    number = _number(value)
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    if key.endswith("_interval") and isinstance(value, list | tuple) and len(value) == 2:
        low, high = (_number(v) for v in value)
        return "—" if low is None or high is None else f"{low:.2f}-{high:.2f}x"
    if isinstance(value, dict | list):
        return json.dumps(value)
    if isinstance(value, float) and number is None:  # a JSON's NaN or Infinity: no figure
        return "—"
    if number is None:
        return str(value)
    if key.endswith("_bytes"):  # in the unit the terminal's table uses: a small model's is no "0.00 GiB"
        return size_text(int(number))
    if key in ("mfu", "mfu_measured") or key.endswith("_ratio"):
        return percent(number, 1)
    if key.startswith("speedup"):
        return f"{number:.2f}x"
    if isinstance(value, int):
        return f"{value:,}" if key != "step" else str(value)
    return number_text(number)
