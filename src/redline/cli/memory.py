"""`redline memory`: a Task's step memory before the run, whether it fits a GPU, and the largest batch that does.

With ``--measure`` the largest batch is found by running training steps on this machine's device instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Annotated

import torch
import typer
from rich.console import Console

from redline.cli.options import TaskArgs, TaskSpec, count, said_by_flags
from redline.cli.signals import stopped_by_signal
from redline.cli.task_args import load_given_task
from redline.errors import ConfigError, invalid
from redline.hardware.device import DeviceFacts, probe_accelerators, probe_device
from redline.hardware.memory import machine_memory_bytes, memory_limit_bytes
from redline.memory.fit import MAX_MEM_GIB, MemoryFit, catalog_memory_note, fit_choices, fit_memory, gpu_facts
from redline.memory.host import free_bytes
from redline.memory.search import check_start, find_batch_size
from redline.parallel.env import read_env
from redline.render.console import output_console, print_uncut, result_out
from redline.render.memory import memory_tables
from redline.render.memory_search import batch_search_table
from redline.runtime.options import RuntimeOptions
from redline.task import Task


def memory(
    task: TaskSpec,
    task_arg: TaskArgs = None,
    batch_size: Annotated[int | None, count("Global batch size (default: the task's own).")] = None,
    precision: Annotated[
        str, typer.Option(help="auto, fp32, bf16-mixed or fp16-mixed (auto: what a run on the device picks).")
    ] = "auto",
    attention: Annotated[
        str,
        typer.Option(
            help="auto, flash, efficient, cudnn or math: the attention kernel the run prefers (auto: torch's pick per "
            "call, or the kernel a cached trial of the task measured faster; math keeps the attention weights)."
        ),
    ] = "auto",
    gpu: Annotated[
        str | None,
        typer.Option(
            metavar="NAME", help='A GPU of the catalog to weigh against, by id or name (h100-sxm, "RTX 4090", l4, ...).'
        ),
    ] = None,
    mem_gib: Annotated[
        float | None,
        typer.Option(
            help="Weigh against a GPU with this many GiB (2^30 bytes) instead, as torch reports its memory: a 24 GB "
            "L4 shows 22.03 GiB, not 24."
        ),
    ] = None,
    gpus: Annotated[int | None, count("GPUs for the FSDP rows of a GPU's estimate (default: 8).")] = None,
    measure: Annotated[
        bool, typer.Option("--measure", help="Find the largest batch by running training steps on this machine.")
    ] = False,
    start: Annotated[
        int | None,
        count("With --measure: the first batch size tried (default: 1; 2 where BatchNorm needs 2)."),
    ] = None,
    max_batch_size: Annotated[
        int | None, count("With --measure: the largest size tried (default: the dataset's size).")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
) -> None:
    """Estimate a Task's training-step memory, whether it fits a GPU, and the largest batch predicted to fit."""
    if gpu is not None and mem_gib is not None:
        raise ConfigError("--gpu and --mem-gib both given\nhint: name a catalog GPU, or give a memory size, not both")
    if mem_gib is not None and not (math.isfinite(mem_gib) and 0 < mem_gib <= MAX_MEM_GIB):
        raise invalid(
            "--mem-gib", mem_gib, f"a finite positive number of GiB, at most {MAX_MEM_GIB} (1 PiB)", "e.g. --mem-gib 24"
        )
    _check_search_flags(measure, gpu, mem_gib, gpus, batch_size, start, max_batch_size)
    weighed = None if measure else _device(gpu, mem_gib)  # before loading the task: a flag mistake shows at once
    if gpus is not None and weighed is not None and weighed[1].type != "cuda":
        raise ConfigError(
            f"--gpus {gpus} sizes the FSDP rows of a GPU's estimate, but this machine has no GPU and none was named, "
            "so nothing would read it\nhint: name the GPU with --gpu NAME or --mem-gib G, or drop --gpus"
        )
    loaded = load_given_task(task, task_arg, stdout_kept=json_output)
    if weighed is None:
        _measure(loaded, precision, attention, start or 1, max_batch_size, json_output)
        return
    device, facts, mem, told = weighed
    here = gpu is None and mem_gib is None
    with said_by_flags(precision="--precision", attention="--attention"):
        weighing = fit_choices(loaded, precision, attention, facts, here=here, batch_size=batch_size)
    chosen, kernel = weighing.precision, weighing.attention
    said = f"{chosen.value}: {chosen.reason}"
    if kernel.value != "auto" and kernel.reason != chosen.reason:  # a trial's one reason says both
        said += f"; {kernel.value} attention: {kernel.reason}"
    err = Console(stderr=True, soft_wrap=True)  # a log or pipe keeps each line whole; a terminal wraps it
    err.print(f"tracing {loaded.name} on fake tensors ({said})", highlight=False, markup=False)
    if weighing.note:
        err.print(f"note: {weighing.note}", highlight=False, markup=False)
    # a CPU's step is weighed against the memory free now: its run will need an interpreter and torch as this
    # process holds them, and what other processes hold (MemTotal counts it) is not the run's to take
    free = free_bytes() / 2**30 if facts.type == "cpu" else None
    with stopped_by_signal("tracing the model", "nothing was estimated"):
        result = fit_memory(
            loaded, device=device, mem_gib=mem, target=facts.type, batch_size=weighing.micro_batch or batch_size,
            precision=chosen.value, gpus=8 if gpus is None else gpus, attention=kernel.value,
            grad_accum=weighing.grad_accum, free_gib=free,
        )  # fmt: skip
    if told:  # which figure of a catalog GPU's memory it was weighed against
        result = dataclasses.replace(result, notes=(told, *result.notes))
    _print(result, json_output)


def _check_search_flags(
    measure: bool,
    gpu: str | None,
    mem_gib: float | None,
    gpus: int | None,
    batch_size: int | None,
    start: int | None,
    max_batch_size: int | None,
) -> None:
    """Refuse flags that the chosen way (an estimate, or ``--measure``'s search) would not read."""
    if measure and (gpu is not None or mem_gib is not None):
        raise ConfigError(
            "--measure runs on this machine's own device; --gpu and --mem-gib weigh an estimate against another\n"
            "hint: drop --gpu/--mem-gib to measure here, or drop --measure to estimate for that GPU"
        )
    if measure and gpus is not None:
        raise ConfigError(
            f"--gpus {gpus} sizes the FSDP rows of an estimate; --measure runs on this machine's device and would "
            "ignore it\nhint: drop --gpus; to search on several GPUs, run it under redline launch, where every "
            "process searches together"
        )
    if measure and batch_size is not None:
        raise ConfigError(
            f"--batch-size {batch_size} with --measure: the search tries its own sizes and would ignore it\n"
            "hint: pass --start N to begin the search at N, or drop --measure to estimate that batch"
        )
    if not measure and (start is not None or max_batch_size is not None):
        given = "--start" if start is not None else "--max-batch-size"
        raise ConfigError(
            f"{given} bounds the search that --measure runs; without --measure nothing would read it\n"
            "hint: add --measure to find the largest batch by running it here, or drop it to estimate"
        )
    if start is not None and max_batch_size is not None:  # before the task loads and the search says it runs
        with said_by_flags(start="--start", max_batch_size="--max-batch-size"):
            check_start(start, max_batch_size, capped=True)


def _measure(
    task: Task, precision: str, attention: str, start: int, max_batch_size: int | None, json_output: bool
) -> None:
    """Search this machine's device for the largest batch that trains; every rank searches, the first prints."""
    Console(stderr=True, soft_wrap=True).print(f"running training steps of {task.name} at growing batch sizes")
    flags = said_by_flags(
        start="--start", max_batch_size="--max-batch-size", precision="--precision", attention="--attention"
    )
    with flags, stopped_by_signal("measuring batch sizes", _found_so_far):
        options = RuntimeOptions.build(None, precision=precision, attention=attention)
        search = find_batch_size(task, options=options, start=start, max_batch_size=max_batch_size)
    if read_env().rank != 0:
        return
    # the search speaks of its argument, the user typed its flag: "the cap (--max-batch-size 64)"
    flagged = [re.sub(r"(?<![\w-])max_batch_size[= ]", "--max-batch-size ", t) for t in (search.reason, *search.notes)]
    search = dataclasses.replace(search, reason=flagged[0], notes=tuple(flagged[1:]))
    if json_output:
        print(json.dumps(search.to_dict(), indent=2), file=result_out())
    else:
        output_console().print(batch_search_table(search.to_dict()))


def _found_so_far(stop: KeyboardInterrupt) -> str:
    """What a search stopped early had found: the largest batch that trained, and the sizes tried."""
    tried = getattr(stop, "tried", ())
    fitted = [size for size, ok, _ in tried if ok]
    ran = ", ".join(f"{size} {'trained' if ok else 'did not fit'}" for size, ok, _ in tried)
    if not fitted:
        return f"no batch size had trained yet ({ran})" if ran else "no batch size had run yet"
    return f"the largest batch that trained so far is {max(fitted)} ({ran}); a larger one may train too"


def _device(gpu: str | None, mem_gib: float | None) -> tuple[str, DeviceFacts, float, str]:
    """The device to weigh against: a catalog GPU, a GPU of a given size, or this machine's own; its name, facts,
    GiB, and a note on which figure of its memory that is, where the name leaves it open (a catalog GPU's)."""
    if gpu is not None:
        spec, facts = gpu_facts(gpu)
        return spec.name, facts, spec.weighed_gib, catalog_memory_note(spec)
    if mem_gib is not None:  # a GPU of that size, as recent as bf16
        facts = DeviceFacts(type="cuda", name=f"a {mem_gib:.10g} GiB GPU", capability=(8, 0), mem_gib=mem_gib)
        return facts.name, facts, mem_gib, ""
    if probe_accelerators().cuda_count:
        facts = probe_device(torch.device("cuda", 0))
        return facts.name, facts, facts.mem_gib or 0.0, ""
    facts = dataclasses.replace(probe_device(torch.device("cpu")), name="this machine's CPU")
    machine, limit = machine_memory_bytes(), memory_limit_bytes()
    if limit is not None and limit < machine:  # a container or a job: the kernel kills the process past its limit
        facts = dataclasses.replace(facts, name="this machine's CPU, under its cgroup's memory limit")
        return facts.name, facts, limit / 2**30, ""
    return facts.name, facts, machine / 2**30, ""


def _print(result: MemoryFit, json_output: bool) -> None:
    if json_output:
        print(json.dumps(result.to_dict(), indent=2), file=result_out())
        return
    out = output_console()
    for table in memory_tables(result):
        print_uncut(out, table)
    for line in note_lines(result):
        out.print(line, highlight=False, markup=False)


def note_lines(result: MemoryFit) -> list[str]:
    """The notes under the tables, each once: the first row's (most hold for every row), then each other row's
    own, naming the rows that carry it (FSDP's split of the batch over its ranks), then the fit's (a batch past
    the training set's size)."""
    first = result.rows[0].estimate.notes
    carried: dict[str, list[str]] = {}
    for row in result.rows[1:]:
        for note in row.estimate.notes:
            if note not in first:
                carried.setdefault(note, []).append(row.label)
    return [
        *(f"note: {note}" for note in first),
        *(f"note ({'; '.join(rows)}): {note}" for note, rows in carried.items()),
        *(f"note: {note}" for note in result.notes),
    ]
