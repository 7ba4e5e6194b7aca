"""Rich tables for the terminal; their text is a result's, shown as written (never read as rich markup)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TextIO

from rich.console import Console
from rich.measure import Measurement
from rich.progress import Progress, ProgressColumn
from rich.table import Column, Table
from rich.text import Text

from redline.plan import Choice, Plan, show_value

# A file, a pipe or a CI log has no width of its own; rich would take 80 columns and cut the cells of a
# wide table (the bench's) to "9,…". Results printed there get this many, unless $COLUMNS says otherwise.
UNBOUNDED_WIDTH = 200
# ...but a table's wrapping text (a Plan's reasons) wraps there at this width, as in a wide terminal, rather
# than stretching every row of the table to UNBOUNDED_WIDTH.
READABLE_WIDTH = 120
# A column that folds a word too long for it (a Plan's reasons) keeps this much of the word a line, where the
# terminal is narrower than the table: a reason one letter a line cannot be read.
FOLDED_WIDTH = 8


def output_console() -> Console:
    """The console for a command's results on stdout: a terminal's own width, else ``UNBOUNDED_WIDTH``."""
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = UNBOUNDED_WIDTH
    return console


def print_uncut(console: Console, table: Table) -> None:
    """Print a table whole, never a cell cut to "…" (rich would cut a figure to "8,…", a word to "pin_memory=o…",
    or drop a column to fit a narrow terminal): the wrapping columns share what the terminal leaves evenly, down
    to their ``min_width`` and, in a column that would cut rather than fold, its longest word; where even that
    is too wide, the table prints wider than the terminal. In a file or pipe (no terminal, no $COLUMNS) they
    share ``READABLE_WIDTH``."""
    target = READABLE_WIDTH if _unbounded(console) else console.width
    flexible = [column for column in table.columns if not column.no_wrap and column.width is None]
    least = {id(column): _least_width(console, table, column) for column in flexible}
    max_widths = {id(column): column.max_width for column in flexible}
    for column in flexible:  # a cap on a wrapping column (the Plan's values) wraps its words, never cuts one
        if column.max_width is not None:
            column.max_width = max(column.max_width, least[id(column)])
    width = console.width
    try:
        if _width_of(console, table) > target:
            _share(console, table, flexible, least, target)
        console.width = max(width, _width_of(console, table))  # print(width=...) would not go past the console's
        console.print(table)
    finally:
        console.width = width
        for column in flexible:
            column.width = None
            column.max_width = max_widths[id(column)]


def _share(console: Console, table: Table, flexible: list[Column], least: dict[int, int], target: int) -> None:
    """Set the width of each ``flexible`` column so that ``table`` takes ``target`` columns, or its least."""
    for column in flexible:
        column.width = least[id(column)]
    fixed = _width_of(console, table)
    spare = max(0, target - fixed)
    wants = {}
    for column in flexible:  # what each needs past its least, the others at theirs
        column.width = None
        wants[id(column)] = _width_of(console, table) - fixed
        column.width = least[id(column)]
    # An even share each, the room a column needs less than its share goes to the others: a short value is
    # whole, and a long reason beside it is not left one character wide.
    by_need = sorted(flexible, key=lambda column: wants[id(column)])
    for left, column in zip(range(len(by_need), 0, -1), by_need, strict=True):
        given = min(wants[id(column)], spare // left)
        column.width = least[id(column)] + given
        spare -= given


def _least_width(console: Console, table: Table, column: Column) -> int:
    """The narrowest ``column`` may be: its ``min_width`` and its longest word, header included, where it cuts
    what overflows (rich's default, "ellipsis"); where it folds a word onto the next line, up to
    ``FOLDED_WIDTH`` of that word."""
    cells = [*column.cells, column.header] if table.show_header else list(column.cells)
    options = console.options.update(max_width=10_000)
    longest = max((Measurement.get(console, options, cell).minimum for cell in cells), default=1)
    return max(column.min_width or 1, min(longest, FOLDED_WIDTH) if column.overflow == "fold" else longest)


def _unbounded(console: Console) -> bool:
    """Whether ``console`` writes to a file or pipe at ``UNBOUNDED_WIDTH`` (see ``output_console``)."""
    return not console.is_terminal and console.width == UNBOUNDED_WIDTH


def _width_of(console: Console, table: Table) -> int:
    """The width ``table`` takes when nothing limits it."""
    return Measurement.get(console, console.options.update(max_width=10_000), table).maximum


def plan_table(plan: Plan | Mapping[str, Choice[Any]], title: str = "Plan") -> Table:
    """Return a Plan (or an engine's plan, axis -> Choice) as a table: axis, chosen value, reason."""
    table = Table(title=Text(title), title_justify="left", show_lines=False)
    table.add_column("axis", style="bold", no_wrap=True)  # the reason wraps; an axis name never shortens
    table.add_column("value", style="cyan", max_width=24)  # a long value (the loader's) wraps: the reason needs room
    table.add_column("why", overflow="fold")  # a token wider than the column folds onto the next line, never cut
    rows = plan.rows() if isinstance(plan, Plan) else [(a, show_value(c.value), c.reason) for a, c in plan.items()]
    for axis, value, reason in rows:
        table.add_row(Text(axis), Text(value), Text(reason))  # a reason's `[...]` is text, not markup
    return table


def key_value_table(rows: Iterable[tuple[str, str]], title: str) -> Table:
    """Return a two-column table of named figures."""
    table = Table(title=Text(title), title_justify="left", show_header=False)
    table.add_column("figure", style="bold")
    table.add_column("value", overflow="fold")  # a long path folds, never cut to "…"
    for key, value in rows:
        table.add_row(Text(key), Text(value))
    return table


def transient_bar(*columns: ProgressColumn | str, console: Console, **options: Any) -> Progress:
    """A progress bar that leaves nothing behind: drawn in a terminal, and in a file or pipe not even the blank
    line a transient bar ends with there (the first line of a log, or before the error a run stopped with)."""
    return Progress(*columns, console=console, transient=True, disable=not console.is_terminal, **options)


_RESULT: list[TextIO] = []  # the stdout a command's result goes to while the rest of its output is on stderr


@contextlib.contextmanager
def results_apart(asked: bool) -> Iterator[None]:
    """Where ``asked`` (the command prints its result as --json), send all else it prints to stderr for the whole
    command: the user's model, loss or data printing as they train or are timed made the JSON unreadable.
    ``result_out`` is the stdout the result goes to."""
    if not asked:
        yield
        return
    _RESULT.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _RESULT.pop()


def result_out() -> TextIO:
    """Where a command prints its result: stdout, as it was before ``results_apart`` sent the rest to stderr."""
    return _RESULT[-1] if _RESULT else sys.stdout
