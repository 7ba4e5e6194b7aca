"""Rich tables for the terminal; their text is a result's, shown as written (never read as rich markup)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Console
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
