"""Rich tables for the terminal; their text is a result's, shown as written (never read as rich markup)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Console
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from redline.plan import Choice, Plan, show_value

# A file, a pipe or a CI log has no width of its own; rich would take 80 columns and cut the cells of a
# wide table (the bench's) to "9,…". Results printed there get this many, unless $COLUMNS says otherwise.
UNBOUNDED_WIDTH = 200


def output_console() -> Console:
    """The console for a command's results on stdout: a terminal's own width, else ``UNBOUNDED_WIDTH``."""
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = UNBOUNDED_WIDTH
    return console


def print_uncut(console: Console, table: Table) -> None:
    """Print a table whole: where the terminal is narrower than its least width, wider than the terminal
    (whose lines then wrap), since rich would otherwise cut its figures to "8,…"."""
    width = console.width
    console.width = _least_uncut_width(console, table, width)  # print(width=...) would not go past the console's
    try:
        console.print(table)
    finally:
        console.width = width


def _least_uncut_width(console: Console, table: Table, width: int) -> int:
    """The least width, from ``width`` up, at which no cell of ``table`` is cut to an ellipsis or off the edge."""

    def cut(at: int) -> bool:
        lines = Segment.split_lines(console.render(table, console.options.update_width(at)))
        return any(Segment.get_line_length(line) > at or any("…" in s.text for s in line) for line in lines)

    if not cut(width):
        return width
    low, high = width, max(width, UNBOUNDED_WIDTH)  # cut at low; a table wider still is cut at high too
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if cut(middle) else (low, middle)
    return high


def plan_table(plan: Plan | Mapping[str, Choice[Any]], title: str = "Plan") -> Table:
    """Return a Plan (or an engine's plan, axis -> Choice) as a table: axis, chosen value, reason."""
    table = Table(title=Text(title), title_justify="left", show_lines=False)
    table.add_column("axis", style="bold", no_wrap=True)  # the reason wraps; an axis name never shortens
    table.add_column("value", style="cyan")
    table.add_column("why")
    rows = plan.rows() if isinstance(plan, Plan) else [(a, show_value(c.value), c.reason) for a, c in plan.items()]
    for axis, value, reason in rows:
        table.add_row(Text(axis), Text(value), Text(reason))  # a reason's `[...]` is text, not markup
    return table


def key_value_table(rows: Iterable[tuple[str, str]], title: str) -> Table:
    """Return a two-column table of named figures."""
    table = Table(title=Text(title), title_justify="left", show_header=False)
    table.add_column("figure", style="bold")
    table.add_column("value")
    for key, value in rows:
        table.add_row(Text(key), Text(value))
    return table
