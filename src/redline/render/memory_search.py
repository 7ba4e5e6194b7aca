"""A batch-size search as a terminal table: each size in the order tried, then the answer and what it assumes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.text import Text

from redline.render.memory import titled_table


def batch_search_table(result: Mapping[str, Any]) -> Group:
    """Return a batch-size search (``BatchSearch.to_dict()``) as a table, one row per size tried, in order, then
    the answer and its notes below it (as the table's caption they would wrap at its width)."""
    processes = f" on each of {result['world_size']} processes" if result["world_size"] > 1 else ""
    table = titled_table(
        f"Batch-size search on {result['device']} ({result['precision']}{processes}), "
        f"{result['steps']} training steps per size"
    )
    table.add_column("batch size", justify="right")
    table.add_column("fits")
    table.add_column("out of memory")
    for tried in result["tried"]:
        fits = "[green]yes[/green]" if tried["fitted"] else "[red]no[/red]"
        table.add_row(str(tried["batch_size"]), fits, escape(tried["error"]))
    lines = [f"largest batch: {result['reason']}"]  # the reason begins with it: "9 fits; 10 ran out of memory"
    lines.append(f"precision {result['precision']}: {result['precision_reason']}")  # auto's says what it measured
    lines += [f"- {note}" for note in result["notes"]]
    return Group(table, Text("\n".join(lines)))
