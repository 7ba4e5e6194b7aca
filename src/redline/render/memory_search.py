"""A batch-size search as a terminal table: each size in the order tried, then the answer and what it assumes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.markup import escape
from rich.table import Table


def batch_search_table(result: Mapping[str, Any]) -> Table:
    """Return a batch-size search (``BatchSearch.to_dict()``) as a table, one row per size tried, in order."""
    processes = f" on each of {result['world_size']} processes" if result["world_size"] > 1 else ""
    table = Table(
        title=f"Batch-size search on {result['device']} ({result['precision']}{processes}), "
        f"{result['steps']} training steps per size",
        title_justify="left",
    )
    table.add_column("batch size", justify="right")
    table.add_column("fits")
    table.add_column("out of memory")
    for tried in result["tried"]:
        fits = "[green]yes[/green]" if tried["fitted"] else "[red]no[/red]"
        table.add_row(str(tried["batch_size"]), fits, escape(tried["error"]))
    lines = [f"largest: {result['largest'] if result['largest'] is not None else 'none'}: {result['reason']}"]
    lines += [f"- {note}" for note in result["notes"]]
    table.caption = escape("\n".join(lines))
    table.caption_justify = "left"
    return table
