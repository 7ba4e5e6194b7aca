"""`redline train`: train a Task with the Runtime and print the Plan and the summary."""

from __future__ import annotations

import ast
import json
from enum import Enum
from typing import Annotated, Any

import typer
from rich.console import Console

from redline.errors import invalid
from redline.report.console import key_value_table, plan_table
from redline.task import load_task
from redline.train.loop import TrainConfig, TrainSummary
from redline.train.loop import train as run_training


class Switch(str, Enum):
    auto = "auto"
    on = "on"
    off = "off"


def parse_task_args(pairs: list[str]) -> dict[str, Any]:
    """Turn repeated ``KEY=VALUE`` strings into keyword options; values read as Python literals."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise invalid("--task-arg", pair, "KEY=VALUE with KEY a Python identifier", "e.g. --task-arg n_layer=4")
        try:
            value: Any = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word is a string: --task-arg name=tiny
        options[key.strip()] = value
    return options


def train(
    task: Annotated[str, typer.Option(help="Task spec: example:digits, pkg.module:factory or file.py:factory.")],
    task_arg: Annotated[
        list[str] | None, typer.Option("--task-arg", help="KEY=VALUE option for the task factory; repeatable.")
    ] = None,
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many optimizer steps.")] = None,
    epochs: Annotated[int | None, typer.Option(help="Epochs to train (default: the task's own).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Batch size (default: the task's own).")] = None,
    precision: Annotated[str, typer.Option(help="auto, fp32, bf16-mixed or fp16-mixed.")] = "auto",
    compile: Annotated[Switch, typer.Option(help="torch.compile: auto, on or off.")] = Switch.auto,
    channels_last: Annotated[Switch, typer.Option(help="channels_last memory layout: auto, on or off.")] = Switch.auto,
    devices: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or mps.")] = "auto",
    grad_accum: Annotated[int, typer.Option(help="Micro-batches per optimizer step.")] = 1,
    clip_grad_norm: Annotated[float | None, typer.Option(help="Clip the gradient norm to this value.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed every random number generator.")] = None,
    out: Annotated[str | None, typer.Option(help="Write summary.json and model.safetensors here.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
) -> None:
    """Train a Task with every automatic choice explained, and print the summary."""
    loaded = load_task(task, **parse_task_args(task_arg or []))
    config = TrainConfig(
        epochs=epochs,
        max_steps=max_steps,
        batch_size=batch_size,
        out_dir=out,
        runtime={
            "devices": devices,
            "precision": precision,
            "compile": compile.value,
            "channels_last": channels_last.value,
            "grad_accum": grad_accum,
            "clip_grad_norm": clip_grad_norm,
            "seed": seed,
        },
    )
    err = Console(stderr=True)
    summary = run_training(loaded, config, log=lambda line: err.print(line, highlight=False))
    if json_output:
        print(json.dumps(summary.to_dict(), indent=2))
        return
    console = Console()
    console.print(plan_table(summary.plan))
    console.print(key_value_table(_summary_rows(summary), title=f"Trained {summary.task}"))
    if summary.sample:
        console.print("[bold]sample[/bold]", summary.sample, sep="\n", highlight=False)


def _summary_rows(summary: TrainSummary) -> list[tuple[str, str]]:
    rows = [
        ("device", summary.device),
        ("steps", f"{summary.steps} ({summary.epochs:g} epochs, {summary.samples} samples)"),
        ("final loss", f"{summary.final_loss:.4f} (mean of the last steps)"),
        ("samples/s", f"{summary.samples_per_s:,.0f} (after the first step)"),
        ("train time", f"{summary.train_seconds:.1f} s"),
    ]
    if summary.compile_seconds is not None:
        rows.append(("compile time", f"{summary.compile_seconds:.1f} s"))
    if summary.val_loss is not None:
        rows.append(("val loss", f"{summary.val_loss:.4f}"))
    if summary.val_metric is not None:
        rows.append(("val metric", f"{summary.val_metric:.4f}"))
    return rows
