"""`redline train`: train a Task with the Trainer and print the Plan and the summary."""

from __future__ import annotations

import ast
import json
import os
import sys
from enum import Enum
from typing import Annotated, Any

import typer
from rich.console import Console

from redline.cli.launch import parse_nproc
from redline.errors import invalid
from redline.launch.torchrun import LaunchConfig, launch
from redline.report.console import key_value_table, plan_table
from redline.runtime.runtime import RuntimeOptions
from redline.task import load_task
from redline.train.callbacks import EarlyStopping
from redline.train.trainer import Trainer, TrainSummary


class Switch(str, Enum):
    auto = "auto"
    on = "on"
    off = "off"


class Monitor(str, Enum):
    val_loss = "val_loss"
    val_metric = "val_metric"


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
    seed: Annotated[
        int | None, typer.Option(help="Seed every RNG and the data order (default 0 for the order).")
    ] = None,
    out: Annotated[str | None, typer.Option(help="Write checkpoints, logs, summary.json, model.safetensors.")] = None,
    resume: Annotated[str | None, typer.Option(help="'auto' (newest valid checkpoint in OUT) or a path.")] = None,
    eval_every: Annotated[int | None, typer.Option(help="Evaluate every N steps (default: each epoch).")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="Checkpoint every N steps (and at the end).")] = None,
    keep_checkpoints: Annotated[int, typer.Option(help="Keep the newest K checkpoints.")] = 3,
    logger: Annotated[
        list[str] | None, typer.Option("--logger", help="csv, jsonl, tensorboard; repeatable (default csv+jsonl).")
    ] = None,
    log_every: Annotated[int, typer.Option(help="Read losses and log every N steps.")] = 50,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress on stderr.")] = True,
    early_stopping_patience: Annotated[
        int | None, typer.Option(help="Stop after N evaluations without improvement.")
    ] = None,
    early_stopping_monitor: Annotated[Monitor, typer.Option(help="The metric early stopping watches.")] = (
        Monitor.val_loss
    ),
    deterministic: Annotated[bool, typer.Option(help="torch.use_deterministic_algorithms(True).")] = False,
    strategy: Annotated[str, typer.Option(help="auto, single, ddp or fsdp (with several processes).")] = "auto",
    nproc: Annotated[
        str | None, typer.Option(help="Run on N processes (or auto: every GPU) through redline launch.")
    ] = None,
    max_restarts: Annotated[int, typer.Option(help="With --nproc: restart failed workers up to K times.")] = 0,
    hang_timeout: Annotated[float | None, typer.Option(help="With --nproc: seconds before a hang report.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
) -> None:
    """Train a Task with every automatic choice explained, and print the summary."""
    if nproc is not None and "RANK" not in os.environ:  # not yet a worker: start the workers
        config = LaunchConfig(nproc=parse_nproc(nproc), max_restarts=max_restarts, hang_timeout_s=hang_timeout)
        launch(config, ["redline", *without_launch_options(sys.argv[1:])], module=True)
        return
    loaded = load_task(task, **parse_task_args(task_arg or []))
    trainer = Trainer(
        loaded,
        runtime=RuntimeOptions(
            devices=devices,
            precision=precision,
            compile=compile.value,
            channels_last=channels_last.value,
            grad_accum=grad_accum,
            clip_grad_norm=clip_grad_norm,
            seed=seed,
            strategy=strategy,
        ),
        max_steps=max_steps,
        max_epochs=epochs,
        batch_size=batch_size,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
        out_dir=out,
        loggers=tuple(logger) if logger else ("csv", "jsonl"),
        log_every=log_every,
        progress=progress,
        early_stopping=(
            EarlyStopping(monitor=early_stopping_monitor.value, patience=early_stopping_patience)
            if early_stopping_patience
            else None
        ),
        resume=resume,
        deterministic=deterministic,
    )
    try:
        summary = trainer.fit()
    finally:
        if trainer.rt is not None:
            trainer.rt.close()
    if not trainer.env.is_main:
        return  # rank 0 reports for the job
    if json_output:
        print(json.dumps(summary.to_dict(), indent=2))
        return
    console = Console()
    console.print(plan_table(summary.plan))
    console.print(key_value_table(summary_rows(summary), title=f"Trained {summary.task}"))
    if summary.sample:
        console.print("[bold]sample[/bold]", summary.sample, sep="\n", highlight=False)


LAUNCH_OPTIONS = ("--nproc", "--max-restarts", "--hang-timeout")


def without_launch_options(argv: list[str]) -> list[str]:
    """Return ``argv`` less the options that start the workers (each worker runs the rest)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCH_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{name}=" for name in LAUNCH_OPTIONS)):
            out.append(arg)
    return out


def summary_rows(summary: TrainSummary) -> list[tuple[str, str]]:
    """Return the summary's figures as (name, text) rows for a table."""
    rows = [
        ("device", summary.device),
        (
            "steps",
            f"{summary.steps} ({summary.epochs:g} epochs, {summary.samples} samples; stopped: {summary.stopped})",
        ),
        ("final loss", f"{summary.final_loss:.4f} (mean of the last steps)"),
        ("samples/s", f"{summary.samples_per_s:,.0f} (after the first step)"),
    ]
    if summary.tokens_per_s:
        rows.append(("tokens/s", f"{summary.tokens_per_s:,.0f}"))
    rows.append(("MFU", f"{summary.mfu:.1%} of {summary.mfu_peak_tflops:g} TFLOP/s" if summary.mfu else "n/a"))
    if summary.measured_peak_ratio is not None:
        rows.append(("of measured matmul peak", f"{summary.measured_peak_ratio:.1%}"))
    rows.append(("train time", f"{summary.train_seconds:.1f} s"))
    if summary.compile_seconds is not None:
        rows.append(("compile time", f"{summary.compile_seconds:.1f} s"))
    if summary.skipped_steps:
        rows.append(("fp16 steps skipped", str(summary.skipped_steps)))
    if summary.val_loss is not None:
        rows.append(("val loss", f"{summary.val_loss:.4f}"))
    if summary.val_metric is not None:
        rows.append(("val metric", f"{summary.val_metric:.4f}"))
    if summary.checkpoint:
        rows.append(("checkpoint", summary.checkpoint))
    if summary.resumed_from:
        rows.append(("resumed from", summary.resumed_from))
    return rows
