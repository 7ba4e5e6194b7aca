"""The parts every redline HTML page is made of: the page and its style, paragraphs, figures, tables, figures' text.

A page loads nothing: its style is inline, its charts are PNGs inside ``data:`` URLs, it has no script, and its
Content-Security-Policy forbids anything else. The callers escape every string that comes from a result; the
headers of a table are escaped here.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from html import escape

from redline.render.bench import percent
from redline.render.memory import size as size_text
from redline.render.page_path import MADE_BY
from redline.render.plots import Chart, number_text
from redline.version import __version__

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


def plan_table(plan: object) -> str:
    """Return a Plan's data (``{axis: {"value", "reason"}}``) as an HTML table: axis, value, why; anything else
    (a file edited by hand, another tool's) as its JSON text."""
    if not isinstance(plan, Mapping):
        return f"<pre>{escape(json.dumps(plan))}</pre>"
    rows = []
    for axis, choice in plan.items():
        value, reason = (choice.get("value"), choice.get("reason", "")) if isinstance(choice, Mapping) else (choice, "")
        rows.append([escape(str(axis)), escape(_plan_value(value)), escape(str(reason))])
    return table(["axis", "value", "why"], rows)


def page(title: str, subtitle: str, body: Iterable[str], footer: str = "") -> str:
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
            paragraph("sub", escape(subtitle)),
            *body,
            f"<footer>{escape(made)}</footer>",
            "</body>",
            "</html>",
            "",
        ]
    )


def paragraph(css_class: str, inner_html: str) -> str:
    return f'<p class="{css_class}">{inner_html}</p>'


def figure(chart: Chart, caption: str = "") -> str:
    data = base64.b64encode(chart.png).decode("ascii")
    img = (
        f'<img src="data:image/png;base64,{data}" alt="{escape(chart.alt)}" '
        f'width="{chart.width_px}" height="{chart.height_px}">'
    )
    return f"<figure>{img}<figcaption>{escape(caption)}</figcaption></figure>" if caption else f"<figure>{img}</figure>"


def table(
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


def finite(value: object) -> float | None:
    """``value`` as a float when it is a finite number (not a bool); None otherwise: a JSON's NaN or Infinity
    (Python's json writes them) is no figure to chart."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _plan_value(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def figure_text(key: str, value: object) -> str:
    """A figure as a person reads it: units from the key's name, thousands separated, None as a dash."""
    number = finite(value)
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    if key.endswith("_interval") and isinstance(value, list | tuple) and len(value) == 2:
        low, high = (finite(v) for v in value)
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
