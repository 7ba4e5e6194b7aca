"""`redline serve`: a model behind HTTP with dynamic batching; prints the engine's Plan and the URL.

The server's flags come from ServeOptions (serve/options.py); the engine's (device, precision,
compile, CUDA graphs) and the model's (SPEC, --weights, --task-arg) are this command's own.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from redline.cli.options import TaskArgs, command, flags, values
from redline.cli.task_args import parse_task_args
from redline.plan import Choice
from redline.serve.engine import InferenceEngine
from redline.serve.options import ServeOptions
from redline.serve.servable import load_servable
from redline.serve.server import serve


def _serve(
    spec: Annotated[
        str, typer.Argument(metavar="SPEC", help="Model spec: example:digits, pkg.module:factory or file.py:factory.")
    ],
    weights: Annotated[
        Path | None, typer.Option(metavar="FILE", help="A safetensors file to load into the model.")
    ] = None,
    task_arg: TaskArgs = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or mps.")] = "auto",
    precision: Annotated[str, typer.Option(help="auto, fp32, bf16-mixed or fp16-mixed.")] = "auto",
    compile: Annotated[str, typer.Option(help="torch.compile: auto, on or off.")] = "auto",
    cuda_graphs: Annotated[str, typer.Option(help="A CUDA graph per batch size: auto, on or off.")] = "auto",
    measure: Annotated[str, typer.Option(help="Time the candidate settings (auto) or plan by rules (off).")] = "auto",
    **parsed: Any,
) -> None:
    """Serve a model over HTTP with dynamic batching, bounded queueing and Prometheus metrics."""
    options = ServeOptions(**values(ServeOptions, parsed))
    options.token()  # an empty --token-env variable is refused before the model loads
    servable = load_servable(spec, weights=weights, **parse_task_args(spec, task_arg or []))
    engine = InferenceEngine(
        servable, device=device, precision=precision, compile=compile, cuda_graphs=cuda_graphs,
        measure=measure, max_batch_size=options.max_batch_size,
    )  # fmt: skip
    console = Console()
    console.print(plan_table(engine.plan, title=f"Serving {servable.name}"))

    def listening(url: str) -> None:
        _say(f"listening on {url} (POST {url}/v1/predict; ready at {url}/readyz once warmed up)")

    serve(engine, options, on_listen=listening, on_ready=lambda: _say("ready: warm-up done"))
    _say("stopped: every accepted request was answered")


def plan_table(plan: dict[str, Choice[Any]], *, title: str) -> Table:
    """Return the engine's plan as a table: axis, chosen value, reason."""
    table = Table(title=title, title_justify="left")
    table.add_column("axis", style="bold", no_wrap=True)
    table.add_column("value", style="cyan")
    table.add_column("why")
    for axis, choice in plan.items():
        value = choice.value
        shown = ", ".join(map(str, value)) if isinstance(value, tuple | list) else str(value)
        table.add_row(axis, shown, choice.reason)
    return table


def _say(line: str) -> None:
    print(line, flush=True)  # flushed: a supervisor reading the pipe sees the URL at once
    sys.stdout.flush()


serve_command = command(_serve, flags(ServeOptions))
