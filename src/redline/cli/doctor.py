"""`redline doctor`: check this machine (or a saved snapshot), print the verdicts and their fixes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from redline.atomic import check_writable, make_parent, read_head, refuse_replacing
from redline.cli.options import given_file, given_path
from redline.doctor import judge, load_snapshot, take_snapshot
from redline.errors import ConfigError, invalid
from redline.render.console import output_console, print_uncut, result_out
from redline.render.doctor import checks_table, devices_table, summary_line


def doctor(
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    quick: Annotated[
        bool,
        typer.Option("--quick", help="The fast answer: no measurements, and torch read without importing it."),
    ] = False,
    save_probe: Annotated[
        Path | None,
        typer.Option(
            "--save-probe",
            metavar="FILE",
            parser=given_file("probe.json"),
            help="Also write the machine's snapshot here, for a bug report.",
        ),
    ] = None,
    probe_file: Annotated[
        Path | None,
        typer.Option(
            "--probe-file",
            metavar="FILE",
            parser=given_path,
            help="Judge a snapshot saved with --save-probe instead of this machine.",
        ),
    ] = None,
) -> None:
    """Check this machine for GPU deep learning, measure its devices, and give the fix for each problem.

    Exits 0 when no check fails and 1 when one does.
    """
    if probe_file is not None and (save_probe is not None or quick):
        flag, value = ("--save-probe", str(save_probe)) if save_probe is not None else ("--quick", True)
        raise invalid(flag, value, "only when probing this machine", f"{flag} has no effect with --probe-file; drop it")
    if save_probe is not None:
        _check_save_probe(save_probe)
    if probe_file is not None:
        snapshot = load_snapshot(probe_file)
    else:
        with Console(stderr=True).status("probing this machine...", spinner="dots"):
            snapshot = take_snapshot(quick=quick)
    if save_probe is not None:
        try:
            snapshot.save(save_probe)
        except OSError as exc:
            raise _unwritable(save_probe, exc) from exc
        said = f"snapshot written to {save_probe}: attach it to your bug report"
        Console(stderr=True).print(said, highlight=False, markup=False, soft_wrap=True)  # a path is never broken
    report = judge(snapshot)
    if json_output:
        print(json.dumps(report.to_dict(), indent=2), file=result_out())
    else:
        console = output_console()
        print_uncut(console, checks_table(report))
        print_uncut(console, devices_table(report))
        console.print(summary_line(report))
    raise typer.Exit(report.exit_code)


def _check_save_probe(path: Path) -> None:
    """Refuse a snapshot file that could not be written, or that holds something else (a run's weights, a script),
    before the probes run, not after them."""
    if path.is_dir():
        raise invalid("--save-probe", str(path), "a file, not a directory", f"e.g. --save-probe {path / 'probe.json'}")
    try:
        make_parent(path)
        check_writable(path)
    except OSError as exc:
        raise _unwritable(path, exc) from exc
    refuse_replacing(path, "--save-probe", kind="snapshot of --save-probe", holds=_is_snapshot, example="probe.json")


def _is_snapshot(path: Path) -> bool:
    """Whether ``path`` holds a snapshot that --save-probe wrote (``Snapshot.save``'s JSON): one is replaced."""
    head = read_head(path)
    return head.lstrip().startswith(b"{") and b'"format_version"' in head and b'"redline_version"' in head


def _unwritable(path: Path, exc: OSError) -> ConfigError:
    why = exc.strerror or str(exc)
    if isinstance(exc, NotADirectoryError) and exc.filename:
        why = f"{exc.filename} is a file, not a directory"
    return invalid(
        "--save-probe", str(path), "a file you can write", f"{why}: pass a path in a directory you can write to"
    )
