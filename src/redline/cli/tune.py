"""`redline tune`: search the settings auto cannot rank by rule, and cache the fastest for `--plan tuned`."""

from __future__ import annotations

import json
import shlex
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

from redline.bench.run import timed_steps
from redline.bench.tune import STREAM_STEPS, WINDOW, tune
from redline.bench.tune_cache import TuneInterrupted
from redline.cli.options import TaskArgs, TaskSpec, count, said_by_flags
from redline.cli.signals import terminate_as_interrupt
from redline.cli.task_args import load_given_task, one_step_named
from redline.config import positive_number
from redline.render.console import key_value_table, output_console, print_uncut, result_out, transient_bar
from redline.runtime.sampling import data_size
from redline.runtime.tuned import TunedPlan


def tune_command(
    task: TaskSpec,
    task_arg: TaskArgs = None,
    devices: Annotated[str, typer.Option(help="The device to tune for: auto, cpu, cuda, cuda:N or mps.")] = "auto",
    budget: Annotated[
        float,
        typer.Option(
            metavar="SECONDS", help="Seconds the search may take: no candidate starts past them (a compile begun ends)."
        ),
    ] = 120.0,
    planned_steps: Annotated[
        int | None, count("The run to weigh total time for, compile included (default: the task's).")
    ] = None,
    batch_size: Annotated[int | None, count("Batch size (default: the task's own).")] = None,
    steps: Annotated[
        int, count("Timed steps per candidate, rounded up to whole windows of 5, and 10 at least.", least=False)
    ] = 30,
    json_output: Annotated[bool, typer.Option("--json", help="Print the tuned Plan as JSON on stdout.")] = False,
) -> None:
    """Search for the fastest settings of a Task within a budget, and cache them for --plan tuned.

    The search covers precision, compile (and its CUDA-graphs mode), channels_last, the attention kernel,
    loader workers and micro-batching, each weighed by the planned run's total time, compile included.
    """
    with said_by_flags(budget_s="--budget"):  # before the task loads, which can take minutes
        positive_number("budget_s", budget)
    loaded = load_given_task(task, task_arg, stdout_kept=json_output)
    console = Console(stderr=True)
    if timed_steps(steps, WINDOW) != steps:  # said before the search, which it lengthens
        told = f"note: --steps {steps} times {timed_steps(steps, WINDOW)} steps per candidate"
        console.print(f"{told}: whole windows of {WINDOW}, two at least", highlight=False, markup=False, soft_wrap=True)
    stream = data_size(loaded.train_data) is None  # `redline train` runs it for --max-steps, which the use line says
    if stream and planned_steps is None:
        told = f"note: train_data is a stream without a length: the search weighs a run of {STREAM_STEPS} steps"
        console.print(f"{told} (--planned-steps N weighs yours)", highlight=False, markup=False, soft_wrap=True)
    with transient_bar(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as bar:
        job = bar.add_task("tune", total=None)

        def tell(done: int, total: int, what: str) -> None:
            bar.update(job, completed=done, total=total, description=what)

        with (
            said_by_flags(budget_s="--budget", devices="--devices"),
            one_step_named(task, task_arg, devices, batch_size),
            terminate_as_interrupt(),  # a scheduler's SIGTERM, as a Ctrl-C, keeps the axes measured
        ):
            try:
                tuned, path = tune(
                    loaded, devices=devices, batch_size=batch_size, budget_s=budget, planned_steps=planned_steps,
                    steps=steps, progress=tell,
                )  # fmt: skip
            except TuneInterrupted as partial:  # show what it measured and cached, then exit 130 (143)
                stopped: TuneInterrupted | None = partial
                tuned, path = partial.kept or partial.tuned, partial.path  # a kept earlier tune is what --plan runs
            else:
                stopped = None
    kept = stopped is not None and stopped.kept is not None
    _show(tuned, path, task, task_arg, devices, batch_size, json_output, kept=kept,
          steps_said=stream or planned_steps is not None)  # fmt: skip
    if stopped is not None:
        raise stopped


def _show(
    tuned: TunedPlan,
    path: str,
    task: str,
    task_arg: list[str] | None,
    devices: str,
    batch_size: int | None,
    json_output: bool,
    *,
    kept: bool = False,
    steps_said: bool = False,
) -> None:
    if json_output:
        print(json.dumps({**tuned.to_dict(), "cached": path, "kept_earlier": kept}, indent=2), file=result_out())
        return
    out = output_console()
    title = f"Tuned {tuned.task} on {tuned.device} for {tuned.planned_steps} steps at batch {tuned.batch_size}"
    print_uncut(out, key_value_table(list(tuned.reasons.items()), title=title))
    chosen = f"chosen: {tuned.best.label}"
    if tuned.unmeasured:  # the label's value of those axes is the search's starting point, not a choice
        chosen = f"{chosen}; left to auto (not measured): {', '.join(tuned.unmeasured)}"
    out.print(chosen, highlight=False, markup=False)
    same = [f"--task-arg {shlex.quote(arg)}" for arg in task_arg or []]  # the run must match the tune's key
    same += [f"--batch-size {batch_size}"] if batch_size is not None else []
    same += [f"--devices {shlex.quote(devices)}"] if devices != "auto" else []
    # the run weighed: --planned-steps, or a stream's (as long as --max-steps says); else the task's epochs, as train's
    same += [f"--max-steps {tuned.planned_steps}"] if steps_said else []
    use = " ".join(["redline train --task", shlex.quote(task), *same, "--plan tuned"])
    # a command to copy: unbroken, and its `[...]` printed as text
    cached = f"nothing new: the earlier tune above, which measured more, stays at {path}" if kept else path
    out.print(f"cached: {cached}\nuse it: {use}", highlight=False, markup=False, soft_wrap=True)
