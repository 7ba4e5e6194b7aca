"""`redline bench`: time the naive loop, a matrix of settings and auto side by side on a Task."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from redline.atomic import check_writable
from redline.bench.run import BenchInterrupted, Estimate, benchmark, timed_steps
from redline.cli.options import TaskArgs, TaskSpec, count, given_file, said_by_flags
from redline.cli.signals import terminate_as_interrupt
from redline.cli.task_args import load_given_task, one_step
from redline.errors import ConfigError, TrainingError, describe_error, invalid
from redline.memory.estimate import estimate_memory
from redline.render.bench import bench_table, best_line
from redline.render.console import output_console, print_uncut, result_out, transient_bar
from redline.render.page_path import refuse_replacing
from redline.render.plots import require_matplotlib
from redline.task import Task

SWITCH = {"on": True, "off": False, "true": True, "false": False}


def bench(
    task: TaskSpec,
    task_arg: TaskArgs = None,
    devices: Annotated[str, typer.Option(help="Devices to bench, comma-separated (auto: CPU and each GPU kind).")] = (
        "auto"
    ),
    precision: Annotated[
        str | None, typer.Option(help="Precisions, comma-separated (default: fp32 and each device's fast one).")
    ] = None,
    compile: Annotated[str, typer.Option(help="torch.compile settings to bench, comma-separated: off, on.")] = "off,on",
    batch_size: Annotated[
        str | None, typer.Option(help="Batch sizes, comma-separated (default: the task's own).")
    ] = None,
    steps: Annotated[int, count("Timed steps per configuration, in whole windows (two at least).")] = 60,
    window: Annotated[int, count("Steps per timing window (one device sync each).")] = 5,
    planned_steps: Annotated[
        int | None, count("The run auto plans for (default: the task's epochs); decides compile.")
    ] = None,
    max_seconds: Annotated[float, typer.Option(help="Stop timing after this many seconds (two rounds at least).")] = (
        300.0
    ),
    auto: Annotated[bool, typer.Option("--auto/--no-auto", help="Bench what `redline train` would run.")] = True,
    estimate: Annotated[
        bool, typer.Option("--estimate/--no-estimate", help="Show the predicted step peak beside the measured one.")
    ] = True,
    isolate: Annotated[
        bool, typer.Option("--isolate", help="Run each row in a process of its own (no shared memory allocator).")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
    html: Annotated[
        Path | None,
        typer.Option(metavar="FILE", parser=given_file("bench.html"), help="Write a self-contained HTML report."),
    ] = None,
) -> None:
    """Time the naive loop, a matrix of settings and auto side by side, and report speed-ups and MFU."""
    if planned_steps is not None and not auto:  # only auto's compile reads it: the matrix's rows set theirs
        hint = "--planned-steps decides whether the auto row compiles; drop it, or drop --no-auto"
        raise invalid("--planned-steps", planned_steps, "only with the auto row", hint)
    loaded = load_given_task(task, task_arg, stdout_kept=json_output)
    if html is not None:
        _check_html(html, task)
    console = Console(stderr=True)
    if timed_steps(steps, window) != steps:  # said before the run, which it lengthens
        told = f"note: --steps {steps} times {timed_steps(steps, window)} steps per row: whole windows of {window}"
        console.print(f"{told} (--window), two at least", highlight=False, markup=False, soft_wrap=True)
    with transient_bar(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        job = bar.add_task("bench", total=None)

        def tell(done: int, total: int, what: str) -> None:
            bar.update(job, completed=done, total=total, description=what)

        try:  # a scheduler's SIGTERM, as a Ctrl-C, keeps the batch sizes finished
            with said_by_flags(max_seconds="--max-seconds", devices="--devices"), terminate_as_interrupt():
                result = benchmark(
                    loaded, devices=devices, precisions=_names(precision), compiles=_switches(compile),
                    batch_sizes=_sizes(batch_size), steps=steps, window=window, planned_steps=planned_steps,
                    max_seconds=max_seconds, auto=auto, progress=tell,
                    estimate=_estimator(loaded, console) if estimate else None, isolate=isolate,
                )  # fmt: skip
        except BenchInterrupted as stopped:  # show (and write) the batch sizes it finished, then exit 130 (143)
            if not stopped.result.rows:
                raise
            interrupted: BenchInterrupted | None = stopped
            result = stopped.result
        else:
            interrupted = None
    data = result.to_dict()
    for row in data["rows"]:  # the runtime's refusal of a row speaks Python: say its fix by the flag typed here
        row["error"] = _by_flag(row["error"])
    _show(data, json_output, html)
    if interrupted is not None:
        raise interrupted
    rows = data["rows"]
    if rows and all(row["error"] for row in rows):  # printed first, but a bench that measured nothing has failed
        sizes, named = set(_sizes(batch_size) or []), _parts(devices, "--devices", "cpu,cuda")
        one = one_step(task, task_arg, named[0] if len(named) == 1 else None, sizes.pop() if len(sizes) == 1 else None)
        problem, _, fix = str(rows[0]["error"]).partition("\nhint: ")  # the row's own fix goes first in the hint
        raise TrainingError(
            f"no configuration of {loaded.name} ran ({len(rows)} failed); the first: {problem}\n"
            f"hint: {fix + '; ' if fix else 'fix the task, then bench again; '}`{one}` runs one step and shows the "
            "line that fails"
        )


def _show(data: dict[str, Any], json_output: bool, html: Path | None) -> None:
    """Print the result (a table, or JSON), then write its page: one that fails to write loses nothing printed."""
    out = output_console()
    if json_output:
        print(json.dumps(data, indent=2), file=result_out())
    else:
        print_uncut(out, bench_table(data))
        out.print(best_line(data), highlight=False, markup=False)  # a task's name is text
    if html is not None:
        from redline.render.html import bench_report, write_report

        write_report(html, bench_report(data))
        said = Console(stderr=True) if json_output else out  # stdout is the JSON alone, for `> bench.json`
        said.print(f"report: {html}", highlight=False, markup=False, soft_wrap=True)  # a path is never broken


def _by_flag(error: str) -> str:
    """A row's error with the arguments it names as this command's flags: "precision='bf16-mixed' is not
    allowed ... hint: use precision='fp16-mixed'" as "--precision='bf16-mixed' ... use --precision 'fp16-mixed'"."""
    said = re.sub(r"^(precision|compile)=", r"--\1=", error)  # the house format's head, as said_by_flags says it
    return re.sub(r"(?<![\w.-])(precision|compile)=", r"--\1 ", said)


def _check_html(path: Path, spec: str) -> None:
    """Refuse a page that could not be written before the bench runs, not after: its result would be lost.
    Refuse one that would replace the task's own file (``spec``'s), whose code would be lost.

    A missing directory is created with the page, as `redline train --out` creates its own; here only its
    nearest existing directory is tried, so a bench refused or stopped before its page leaves none behind.
    """
    require_matplotlib()
    if path.is_dir():
        raise ConfigError(f"--html {str(path)!r} is a directory\nhint: name a file, e.g. {path / 'bench.html'}")
    source = _task_file(spec)
    if path.is_file() and source is not None and source.is_file() and source.samefile(path):
        raise ConfigError(
            f"--html {str(path)!r} is the task's own file ({spec}): the page would replace its code\n"
            f"hint: name another file, e.g. --html {path.with_suffix('.html')}"
        )
    if _is_stdout(path):
        raise ConfigError(
            f"--html {str(path)!r} is the file stdout goes to (`> {path}`): the page would replace what is printed "
            f"there\nhint: send stdout to another file, e.g. `> {path.with_suffix('.json')}`"
        )
    refuse_replacing(path)
    try:
        existing = next(parent for parent in path.parents if parent.exists())  # "." at least
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file is where a directory would be", str(existing))
        # a temporary file where the page will be, or where its first missing directory will be made
        check_writable(path if existing == path.parent else existing / path.name)
    except NotADirectoryError as exc:
        raise ConfigError(
            f"--html {str(path)!r} is in {exc.filename!r}, which is a file, not a directory\n"
            "hint: pass a file in a directory, or a directory to create"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"--html {str(path)!r} cannot be written ({exc.strerror or exc})\n"
            "hint: pass a file in a directory you can write to"
        ) from exc


def _is_stdout(path: Path) -> bool:
    """Whether stdout is ``path`` itself (`--html out.html > out.html`: the shell emptied it first, so it passes as
    an empty file), which the page, written anew, would take the place of, and with it the JSON or table printed."""
    try:
        out, page = os.fstat(1), path.stat()
    except OSError:  # no stdout, or no such file yet
        return False
    if not stat.S_ISREG(page.st_mode):  # /dev/null, a pipe: written into, not replaced (``write_report``)
        return False
    return (out.st_dev, out.st_ino) == (page.st_dev, page.st_ino)


def _task_file(spec: str) -> Path | None:
    """The file that defines the task ``spec`` names (imported by now), or None where it has none."""
    module = spec.rpartition(":")[0]
    if module.endswith(".py") or "/" in module or "\\" in module:
        return Path(os.path.expanduser(module))
    file = getattr(sys.modules.get(module), "__file__", None)
    return Path(file) if file else None


def _estimator(task: Task, console: Console) -> Estimate:
    """Predict a row's step peak with ``estimate_memory``; where the trace fails, warn and bench on."""

    def predict(batch_size: int, precision: str, device_type: str) -> int | None:
        target = "cuda" if device_type == "cuda" else "cpu"
        try:
            return estimate_memory(task, batch_size=batch_size, precision=precision, target=target).total
        except Exception as exc:  # the estimate is an extra: its failure must not lose the measurements
            console.print(  # the error's `[...]` is text, not markup
                f"warning: no memory estimate for batch {batch_size}, {precision}: {describe_error(exc)}",
                markup=False, highlight=False, soft_wrap=True,
            )  # fmt: skip
            return None

    return predict


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [name.lower() for name in _parts(text, "--precision", "fp32,bf16-mixed")]  # FP32 as --compile takes ON
    if not names:
        raise ConfigError(f"--precision {text!r} names nothing\nhint: e.g. --precision fp32,bf16-mixed")
    return names


def _parts(text: str, flag: str, example: str) -> list[str]:
    """The items of a comma-separated list; a blank one between commas (``16,`` or ``fp32,,bf16``) is refused."""
    parts = [part.strip() for part in text.split(",")]
    if any(parts) and not all(parts):  # a list of blanks alone names nothing, as the flag's own check says
        raise ConfigError(f"{flag} {text!r} has an empty item between commas\nhint: e.g. {flag} {example}")
    return [part for part in parts if part]


def _switches(text: str) -> list[bool]:
    names = _parts(text, "--compile", "off,on")
    unknown = [name for name in names if name.lower() not in SWITCH]
    if unknown or not names:
        raise ConfigError(f"--compile {text!r}: expected on and/or off\nhint: e.g. --compile off,on")
    return [SWITCH[name.lower()] for name in names]


def _sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    parts = _parts(text, "--batch-size", "32,64")
    try:
        sizes = [int(part) for part in parts]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes):
        raise ConfigError(f"--batch-size {text!r}: expected positive integers\nhint: e.g. --batch-size 32,64")
    return sizes
