"""`redline profile`: where a training step's time goes, phase by phase, and what to try."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from redline.bench.profiling import profile
from redline.cli.options import TaskArgs, TaskSpec, count, given_file, said_by_flags
from redline.cli.signals import stopped_by_signal
from redline.cli.task_args import load_given_task, one_step_named
from redline.errors import invalid
from redline.render.console import output_console, plan_table, print_uncut, result_out
from redline.render.profile import header_line, ops_table, phases_table, summary_lines


def profile_command(
    task: TaskSpec,
    task_arg: TaskArgs = None,
    devices: Annotated[str, typer.Option(help="The device to profile on: auto, cpu, cuda, cuda:N or mps.")] = "auto",
    precision: Annotated[
        str | None,
        typer.Option(help="auto, fp32, bf16-mixed or fp16-mixed (default auto: what `redline train` would run)."),
    ] = None,
    compile: Annotated[
        str | None, typer.Option(help="torch.compile: auto, on or off (default: what `redline train` would run).")
    ] = None,
    compile_mode: Annotated[
        str,
        typer.Option(
            help="torch.compile mode: default, reduce-overhead (CUDA graphs) or max-autotune; "
            "a mode other than default profiles the step compiled."
        ),
    ] = "default",
    cuda_graphs: Annotated[
        str | None,
        typer.Option(
            help="CUDA graphs of the forward and backward: on, off or auto (default: what `redline train` would run)."
        ),
    ] = None,
    batch_size: Annotated[int | None, count("Batch size (default: the task's own).")] = None,
    steps: Annotated[int, count("Steps to record, after the warm-up.")] = 10,
    warmup: Annotated[int, count("Steps to run first, unrecorded (compiling, if it compiles).")] = 5,
    planned_steps: Annotated[
        int | None, count("The run auto plans for (default: the task's epochs); decides compile.")
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE", parser=given_file("trace.json.gz"), help="Write the Chrome trace there (.json or .json.gz)."
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the profile as JSON on stdout.")] = False,
) -> None:
    """Profile a Task's training steps: each phase's time, the heaviest operators, and what to try."""
    if compile is not None and compile.lower() not in ("auto", "on", "off"):
        raise invalid("--compile", compile, "auto, on or off", "e.g. --compile on")
    loaded = load_given_task(task, task_arg, stdout_kept=json_output)
    flags = {"devices": "--devices", "precision": "--precision", "trace": "--trace", "compile_mode": "--compile-mode",
             "compile": "--compile", "cuda_graphs": "--cuda-graphs"}  # fmt: skip
    with (
        said_by_flags(**flags),
        stopped_by_signal("profiling", "nothing was written"),
        one_step_named(task, task_arg, devices, batch_size),
    ):
        found = profile(
            loaded, devices=devices, precision=precision, compile=compile.lower() if compile else None,
            compile_mode=compile_mode, cuda_graphs=cuda_graphs.lower() if cuda_graphs else None,
            batch_size=batch_size, steps=steps, warmup=warmup, planned_steps=planned_steps, trace=trace,
        )  # fmt: skip
    data = found.to_dict()
    if json_output:
        print(json.dumps(data, indent=2), file=result_out())
        return
    out = output_console()
    print_uncut(out, plan_table(found.plan))
    out.print(header_line(data), highlight=False, markup=False)
    print_uncut(out, phases_table(data))
    print_uncut(out, ops_table(data))
    for line in summary_lines(data):
        out.print(line, highlight=False, markup=False, soft_wrap=True)  # the terminal wraps: a path stays whole
