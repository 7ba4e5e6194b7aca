"""The `redline` command: one thin module per subcommand, each parsing, calling the library, rendering."""

from __future__ import annotations

import sys

import typer

from redline.cli import doctor as doctor_cmd
from redline.cli import launch as launch_cmd
from redline.cli import train as train_cmd
from redline.errors import RedlineError

app = typer.Typer(
    name="redline",
    help="Run plain PyTorch training and inference as fast as the hardware allows, and say why.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("train")(train_cmd.train)
app.command("doctor")(doctor_cmd.doctor)
app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
    launch_cmd.launch_command
)


@app.callback()
def _root() -> None:
    """Run plain PyTorch training and inference as fast as the hardware allows, and say why."""


def main() -> None:
    """Entry point of the console script: a RedlineError becomes one clear message and its exit code (2)."""
    try:
        app()
    except RedlineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
