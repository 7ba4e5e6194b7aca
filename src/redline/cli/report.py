"""`redline report`: a training run's directory as one self-contained HTML page with its charts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from redline.cli.options import given_file
from redline.render.html import report as write_run_report


def report(
    run_dir: Annotated[
        Path,
        typer.Argument(
            metavar="RUN_DIR",
            help="The directory a run wrote with --out, or a bench result saved by `redline bench --json`.",
            show_default=False,
        ),
    ],
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            metavar="FILE",
            parser=given_file("report.html"),
            help="Where to write the page [default: RUN_DIR/report.html, or FILE.html].",
        ),
    ] = None,
) -> None:
    """Write a training run's HTML report: its loss, throughput and memory charts, summary and Plan.

    Given a bench's JSON (`redline bench --json > bench.json`), write the bench's page (bench.html).

    One self-contained file that loads nothing from the network; needs matplotlib
    (pip install 'redline[report]'). Prints the path of the file it wrote.
    """
    print(write_run_report(run_dir, html))
