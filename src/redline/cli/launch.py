"""`redline launch`: run a script on every GPU or machine through torch.distributed.run."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from redline.cli.options import build, command, flags
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
    module: Annotated[bool, typer.Option("--module", "-m", help="TARGET is a module: python -m TARGET.")] = False,
    **parsed: Any,
) -> None:
    """Run SCRIPT [ARGS...] on N processes (and N machines) with torch.distributed."""
    launch(build(LaunchConfig, parsed), [target, *ctx.args], module=module)


launch_command = command(_launch, flags(LaunchConfig))
