"""`redline launch`: run a script on every GPU or machine through torch.distributed.run."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from redline.cli.options import build, command, flags, said_by_flags, spellings
from redline.launch.torchrun import LaunchConfig, launch


def _launch(
    ctx: typer.Context,
    target: Annotated[
        str,
        typer.Argument(
            metavar="SCRIPT",
            help="The script to run (or a module with --module); every argument after it is the script's own.",
        ),
    ],
    module: Annotated[bool, typer.Option("--module", "-m", help="SCRIPT is a module: python -m SCRIPT.")] = False,
    **parsed: Any,
) -> None:
    """Run SCRIPT [ARGS...] on N processes (and N machines) with torch.distributed."""
    config = build(LaunchConfig, parsed)
    with said_by_flags(**spellings(LaunchConfig)):  # what the launcher refuses before the workers start, by its flag
        launch(config, [target, *ctx.args], module=module)


launch_command = command(_launch, flags(LaunchConfig))
