"""`redline doctor`: check this machine (or a saved snapshot), print the verdicts and their fixes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from redline.doctor import judge, load_snapshot, take_snapshot
from redline.errors import invalid
from redline.render.console import output_console
from redline.render.doctor import checks_table, devices_table, summary_line


def doctor(
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    quick: Annotated[
        bool,
        typer.Option("--quick", help="The fast answer: no measurements, and torch read without importing it."),
    ] = False,
    save_probe: Annotated[
        Path | None, typer.Option("--save-probe", help="Also write the machine's snapshot here, for a bug report.")
    ] = None,
    probe_file: Annotated[
        Path | None,
        typer.Option("--probe-file", help="Judge a snapshot saved with --save-probe instead of this machine."),
    ] = None,
) -> None:
    """Check this machine for GPU deep learning, measure its devices, and give the fix for each problem.

    Exits 0 when no check fails and 1 when one does.
    """
    if probe_file is not None and (save_probe is not None or quick):
        flag = "--save-probe" if save_probe is not None else "--quick"
        raise invalid(flag, True, "only when probing this machine", f"{flag} has no effect with --probe-file; drop it")
    if probe_file is not None:
        snapshot = load_snapshot(probe_file)
    else:
        with Console(stderr=True).status("probing this machine...", spinner="dots"):
            snapshot = take_snapshot(quick=quick)
    if save_probe is not None:
        try:
            snapshot.save(save_probe)
        except OSError as exc:
            raise invalid("--save-probe", str(save_probe), "a writable file path", str(exc)) from exc
        said = f"snapshot written to {save_probe}: attach it to your bug report"
        Console(stderr=True).print(said, highlight=False, markup=False)
    report = judge(snapshot)
    if json_output:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console = output_console()
        console.print(checks_table(report))
        console.print(devices_table(report))
        console.print(summary_line(report))
    raise typer.Exit(report.exit_code)
