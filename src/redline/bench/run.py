"""`redline bench`: time the naive loop, a matrix of settings and auto side by side, and report each row.

Rows of one batch size are timed together, in rounds whose order rotates (``time_steps``): each
row runs one settling step, then a window of steps between two synchronisations, and the next
row takes its turn. A machine whose speed drifts therefore weighs on every row alike, and the
ratios between rows (the speed-ups) are what the bench trusts most. Before timing, each row is
built and warmed up alone (compiling, if it compiles), which is when its peak memory is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import pickle
import platform
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from redline.bench.compile_cache import cache_lookups, reset_compiler, served_from_cache
from redline.bench.isolate import OPTIONS_HINT, RowEnded, RowFailed, RowProcess
from redline.bench.loops import Runner, first_step_seconds, naive_runner, quiet_failed_ops, row_options, runtime_runner
from redline.bench.matrix import Setting, expand, listed
from redline.bench.memory import Peak, PeakMemory
from redline.bench.result import BenchResult, BenchRow
from redline.bench.rows import Built, base_row, bench_rows, row_error, with_speedups
from redline.config import positive_int, positive_number, seed_number
from redline.errors import (
    ConfigError,
    RedlineError,
    StoppedBySignal,
    TaskError,
    describe_error,
    interrupting_signal,
    invalid,
    noting_interrupts,
)
from redline.hardware.contention import Contention, Sampler
from redline.hardware.device import DeviceFacts, probe_accelerators, probe_device
from redline.hardware.flops import count_train_flops
from redline.parallel.env import read_env
from redline.plan import Choice
from redline.plan.device import resolve_device
from redline.runtime.measure import CACHED, NOT_MEASURED, measure_auto
from redline.runtime.options import RuntimeOptions
from redline.runtime.sampling import batches_per_epoch, data_size
from redline.runtime.seed import keeps_rng
from redline.runtime.trial import time_steps
from redline.runtime.tuned import Tuning
from redline.runtime.tuned_run import auto_tuned, whole_where_split_differs
from redline.task import Task, require_task, task_origin
from redline.version import __version__

log = logging.getLogger("redline")
Progress = Callable[[int, int, str], None]  # (done, total, what is running now)
Estimate = Callable[[int, str, str], int | None]  # (batch size, precision, device type) -> predicted bytes


@keeps_rng  # each row seeds torch with ``seed``: the caller's RNG streams go on as they were
def benchmark(
    task: Task,
    *,
    devices: str | Sequence[str] = "auto",
    precisions: Sequence[str] | None = None,
    compiles: Sequence[bool] = (False, True),
    batch_sizes: Sequence[int] | None = None,
    steps: int = 60,
    window: int = 5,
    planned_steps: int | None = None,
    max_seconds: float = 300.0,
    auto: bool = True,
    seed: int = 0,
    progress: Progress | None = None,
    estimate: Estimate | None = None,
    isolate: bool = False,
) -> BenchResult:
    """Time the naive loop, each setting of the matrix and auto on ``task``, side by side; return the rows.

    ``devices`` "auto" benches the CPU and every kind of accelerator visible; ``precisions`` None
    benches fp32 and the reduced precision each device has fast arithmetic for. Each row times
    ``steps`` steps (in windows of ``window``, so rounded up to whole windows, two at least:
    ``timed_steps``) after a warm-up window; timing stops early, after
    two rounds at least, once ``max_seconds`` are spent. ``planned_steps`` is the run auto plans
    for (default: the task's own epochs), which decides whether it compiles. ``estimate(batch_size,
    precision, device_type)`` returns a predicted step peak in bytes (or None) to show beside each
    row's measured peak, e.g. ``lambda b, p, d: redline.estimate_memory(task, batch_size=b,
    precision=p, target=d).total``; it is asked once per batch size, precision and device.

    ``isolate`` runs each row in a process of its own (redline/bench/isolate.py), which loads the task again from
    the spec that loaded it (``redline.load_task``): rows that share a process share its memory allocator, and
    the order they take turns in weighs on their speed.

    A Ctrl-C (KeyboardInterrupt) raises ``BenchInterrupted`` (exit 130 on the command line), whose
    ``result`` holds the rows of the batch sizes finished before it.
    """
    task = require_task(task)
    positive_int("steps", steps)
    positive_int("window", window)
    positive_number("max_seconds", max_seconds)
    positive_int("planned_steps", planned_steps, optional=True)
    seed_number("seed", seed)
    precisions = listed("precisions", precisions, "['fp32', 'bf16-mixed']") if precisions is not None else None
    compiles = listed("compiles", compiles, "[False, True]")
    sizes = (listed("batch_sizes", batch_sizes, "[32, 64]") if batch_sizes is not None else []) or [task.batch_size]
    check_sizes(task, sizes)
    origin = _origin(task) if isolate else None
    facts = [probe_device(torch.device(name)) for name in _devices(devices)]
    asked = "auto" if isinstance(devices, str) and devices.strip() == "auto" else ""
    settings = expand(facts, precisions=precisions, compiles=compiles, batch_sizes=sizes, auto=auto, asked=asked)
    rounds = timed_steps(steps, window) // window
    running = ["setting up"]  # what runs now, for the message of a Ctrl-C (before the first row warms up: its set-up)

    def tell(done: int, total: int, what: str) -> None:
        running[0] = what
        if progress is not None:
            progress(done, total, what)

    total, done = len(settings) + rounds * len(sizes), 0
    sampler = Sampler().start()  # other processes' load on the CPUs while the rows run (theirs counted as ours)
    rows: list[BenchRow] = []
    timed_rounds = rounds  # --max-seconds may stop a batch size's rounds early
    interrupted, signum = "", int(signal.SIGINT)
    task_error: RedlineError | None = None
    with noting_interrupts() as noted:  # a Ctrl-C that Python drops inside a compile's callbacks is noted
        for size in dict.fromkeys(sizes):
            group = [s for s in settings if s.batch_size == size]
            planned = planned_steps or task_steps(task, size)
            try:  # a Ctrl-C keeps the batch sizes finished: the command line shows them, then exits 130
                compiling = {s.device for s in group if s.compile is not False}  # auto's rows may compile too
                if compiling and origin is None:  # each compile timed as a fresh run's, not from an earlier graph
                    reset_compiler(compiling)
                warming = functools.partial(lambda start, index, what: tell(start + index, total, what), done)
                with contextlib.ExitStack() as processes:  # each row's own, under isolate: ended with the batch size
                    if origin is None:
                        built, failed = _warm_up_all(task, group, window, planned, seed, warming)
                    else:
                        job = {"window": window, "planned": planned, "seed": seed}
                        built, failed = _warm_up_isolated(origin, group, job, warming, processes)
                    done += len(group)
                    runners = [runner for runner, _, _ in built.values()]
                    tell_round = functools.partial(_timing, tell, done, total)
                    timed = time_runners(runners, window, rounds, max_seconds, tell_round)
                    done += rounds
                    group_rows = bench_rows(group, built, timed, failed, window)
                timed_rounds = min([timed_rounds, *(len(times) for times, _ in timed.values())])
                noted.raise_lost()  # one raised in a weakref callback or __del__, which Python dropped
            except KeyboardInterrupt as exc:  # Ctrl-C, or a scheduler's SIGTERM where the command line takes it so
                noted.caught()
                signum = interrupting_signal(exc)
                interrupted = f"interrupted ({signal.Signals(signum).name}) while {running[0]} (batch {size})"
                break
            except StoppedBySignal:
                raise
            except RedlineError as exc:  # the task's own at this size (a stream with no full batch of it): its rows
                task_error = task_error or exc  # say so, and the sizes measured before it stay
                group_rows = [dataclasses.replace(base_row(setting), error=str(exc)) for setting in group]
            rows += group_rows
    rows = with_speedups(rows)
    try:
        rows = list(_with_estimates(rows, estimate))
    except KeyboardInterrupt as exc:  # the rows are timed: shown and written without the estimates still to come
        signum = interrupting_signal(exc)
        interrupted = interrupted or f"interrupted ({signal.Signals(signum).name}) while estimating memory"
    result = BenchResult(
        task=task.name,
        steps=timed_rounds * window if any(not row.error for row in rows) else 0,  # 0: every row failed
        window=window,
        measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=_machine(facts, sampler.stop(torch.get_num_threads())),
        versions={"python": platform.python_version(), "torch": torch.__version__, "redline": __version__},
        rows=tuple(rows),
        steps_asked=steps,
        stopped_early=timed_rounds < rounds,
        interrupted=interrupted,
        isolated=isolate,
    )
    if interrupted:
        raise BenchInterrupted(result, signum)
    if task_error is not None and all(row.error for row in rows):  # at every size: the task's error, as raised
        raise task_error
    return result


class BenchInterrupted(StoppedBySignal):
    """A bench a SIGINT (Ctrl-C) or SIGTERM stopped; ``result`` holds the batch sizes it finished before (maybe
    none)."""

    def __init__(self, result: BenchResult, signum: int = signal.SIGINT) -> None:
        if result.interrupted.endswith("while estimating memory"):
            told = "every row was timed, and the table shows them without the memory estimates"
        elif result.rows:
            told = "the table shows the batch sizes finished before it"
        else:
            told = "no batch size was finished, so there is nothing to show"
        super().__init__(
            signum,
            f"bench {result.interrupted}: {told}\nhint: --max-seconds S "
            "bounds each batch size's timing (two rounds at least), and --steps N shortens it",
        )
        self.result = result


def timed_steps(steps: int, window: int) -> int:
    """The steps a row (or a tune's candidate) is timed for when ``steps`` are asked: whole windows, two at least."""
    return max(2, math.ceil(steps / window)) * window


def _with_estimates(rows: list[BenchRow], estimate: Estimate | None) -> list[BenchRow]:
    """Give each row that ran the predicted peak of its batch size, precision and device type: of its micro-batch,
    where a tuned Plan splits the batch (a step's peak is one micro-batch's activations). A failed row has none,
    as it has no other figure, though a row of its settings ran."""
    if estimate is None:
        return rows
    known: dict[tuple[int, str, str], int | None] = {}
    out = []
    for row in rows:
        parts = int((row.plan or {}).get("grad_accum", {}).get("value") or 1)
        key = (row.batch_size // parts, row.precision, torch.device(row.device).type)
        if not row.error and key not in known:
            known[key] = estimate(*key)
        out.append(dataclasses.replace(row, estimate_bytes=None if row.error else known.get(key)))
    return out


def _timing(tell: Progress, done: int, total: int, round_: int) -> None:
    tell(done + round_, total, f"timing, round {round_ + 1}")


def _devices(devices: str | Sequence[str]) -> list[str]:
    names = [d.strip() for d in devices.split(",")] if isinstance(devices, str) else list(devices)
    found = probe_accelerators()
    if names == ["auto"]:
        names = ["cpu", *(["cuda"] if found.cuda_count else []), *(["mps"] if found.mps else [])]
    if not names or any(not n for n in names):
        raise invalid("devices", devices, "device names separated by commas", "e.g. devices='cpu,cuda'")
    return list(dict.fromkeys(resolve_device(name, found).value for name in names))


def check_sizes(task: Task, sizes: Sequence[int]) -> None:
    """Refuse a batch size larger than the data before anything is timed, not after the sizes before it."""
    count = data_size(task.train_data)
    if count is None:
        return  # a stream: the loop starts it again when it runs dry
    too_large = [size for size in sizes if size > count]
    if too_large:
        raise TaskError(
            f"train_data has {count} samples, fewer than the batch size {too_large[0]}\n"
            f"hint: pass batch sizes up to {count} (--batch-size)"
        )


def task_steps(task: Task, batch_size: int) -> int | None:
    """The optimizer steps `redline train` plans for the task's own run, and measures auto's trial by: its epochs'
    batches, a partial last one included (a run that compiles leaves it out, after the trial); None for a stream."""
    size = data_size(task.train_data)
    return max(1, batches_per_epoch(size, batch_size)) * task.epochs if size is not None else None


def _warm_up_all(
    task: Task, group: list[Setting], window: int, planned: int | None, seed: int, tell: Callable[[int, str], None]
) -> tuple[Built, dict[Setting, str]]:
    """Warm up each row of a batch size alone (``tell(index, what)`` as each starts): the rows built, and the
    error of each row that failed."""
    built: Built = {}
    failed: dict[Setting, str] = {}
    for index, setting in enumerate(group):
        tell(index, f"warming up {setting.name}")
        try:
            built[setting] = warm_up(task, setting, window, planned, seed)
        except ConfigError as exc:  # the row's settings do not fit its device (bf16 on a V100): it says why
            failed[setting] = str(exc)
        except RedlineError:  # the task's own (its data, its loss): every row would fail alike
            raise
        except Exception as exc:  # a setting this machine cannot run: its row says why
            failed[setting] = row_error(exc)
    return built, failed


def _warm_up_isolated(
    origin: tuple[str, dict[str, Any]],
    group: list[Setting],
    job: dict[str, Any],
    tell: Callable[[int, str], None],
    processes: contextlib.ExitStack,
) -> tuple[Built, dict[Setting, str]]:
    """``_warm_up_all``, each row in a process of its own (``processes`` ends them): one warms up at a time, as
    the rows are timed, so no row's warm-up (its compile) runs beside another's."""
    built: Built = {}
    failed: dict[Setting, str] = {}
    job = {**job, "threads": torch.get_num_threads(), "log_level": log.getEffectiveLevel()}
    for index, setting in enumerate(group):
        tell(index, f"warming up {setting.name}")
        row = RowProcess(origin, setting, job)
        processes.push(lambda kind, *_, row=row: row.close(now=kind is not None))  # stopped: ended mid-step
        try:
            memory, flops = row.warm_up()
        except RedlineError as exc:
            if not isinstance(exc, ConfigError):  # the task's own: every row would fail alike
                raise
            failed[setting] = str(exc)
        except (RowFailed, RowEnded) as exc:
            failed[setting] = str(exc)
        else:
            built[setting] = (row, memory, flops)
    return built, failed


def _origin(task: Task) -> tuple[str, dict[str, Any]]:
    """The spec and options that load ``task`` again, in each row's process; a Task built in Python has none."""
    origin = task_origin(task)
    if origin is None:
        raise ConfigError(
            "isolate=True runs each row in a process of its own, which loads the task again from the spec that "
            "loaded it; this Task was built in Python (or copied with other fields), so no process can load it\n"
            "hint: load it with redline.load_task('path/to/file.py:make_task', ...), as `redline bench --task` "
            "does, or bench without isolate"
        )
    try:
        pickle.dumps(origin)
    except Exception as exc:  # a lambda, or an object that does not pickle
        raise ConfigError(
            "isolate=True sends the task's options to each row's process, and they do not pickle "
            f"({describe_error(exc)})\nhint: {OPTIONS_HINT}"
        ) from exc
    return origin


def warm_up(
    task: Task, setting: Setting, window: int, planned: int | None, seed: int, options: RuntimeOptions | None = None
) -> tuple[Runner, Peak, int | None]:
    """Build a row's runner and run one untimed window (compiling, if it compiles); read its peak memory.

    An automatic compile's check (its first 35 steps, eager then compiled) runs to its end here too, so the timed
    windows see the form the run keeps, not the switch and its compile.

    ``options`` runs an explicit row with every Runtime option given (a compile mode, say).
    """
    device = torch.device(setting.device)
    measured, tuning = None, None
    started = time.perf_counter()  # auto's trial is part of what its run pays, as a compile is
    if setting.kind == "auto":
        options, measured, tuning = _auto(task, setting, planned)
    elif setting.kind == "explicit":  # a precision left to auto (a profile's, compile given) is auto's, measured
        options = options or row_options(setting)
        measured = _measured(task, options, setting.batch_size, planned)
    trial_s = time.perf_counter() - started
    lookups = cache_lookups()
    with PeakMemory(device) as memory:  # after auto's trial: the copies it trains are not the row's
        if setting.kind == "naive":
            runner = naive_runner(task, setting, seed=seed)
        else:
            runner = runtime_runner(
                task, setting, seed=seed, planned_steps=planned, measured=measured, options=options, tuning=tuning
            )
        with quiet_failed_ops():  # the warm-up compiles
            runner.first_step_s = first_step_seconds(runner)
            runner.run(window - 1)
            while runner.runtime is not None and runner.runtime.compile_checking:
                runner.run(1)
    runner.compile_cached = served_from_cache(lookups, cache_lookups())
    if trialled(measured):
        runner.trial_s, runner.trial_cached = trial_s, any(CACHED in c.reason for c in (measured or {}).values())
    assert runner.first_batch is not None
    flops = count_train_flops(runner.model, task.loss_fn, runner.first_batch)  # of one micro-batch
    return runner, memory.read(), flops * runner.micro_steps if flops is not None else None


def trialled(measured: dict[str, Choice[str]] | None) -> bool:
    """Whether auto's choices came from a precision trial, run or read from redline's cache (not the rule's alone,
    where no trial was asked: the precision given, or a run too short to repay one)."""
    return any(NOT_MEASURED not in choice.reason for choice in (measured or {}).values())


def _auto(
    task: Task, setting: Setting, planned: int | None
) -> tuple[RuntimeOptions | None, dict[str, Choice[str]] | None, Tuning | None]:
    """What `redline train` would run on the row's device at its batch size, by train's own rules: the
    cached tuned Plan (its options, micro-batches included where a run of the task's epochs, or of ``planned`` steps
    where --planned-steps said another length, would take them; and its reasons), else auto's rules with
    the precision a trial measured, where the planned run repays one or a measurement is cached. A
    precision the tuned Plan left to the run's auto (its budget spent first) is measured so too."""
    options, env = row_options(setting), read_env()
    tuned = auto_tuned(task, options, setting.batch_size, env, planned_steps=planned)
    own = planned == task_steps(task, setting.batch_size)  # else as `train --max-steps N`: no end of epochs ends it
    epochs, steps = (task.epochs, None) if own else (math.inf, planned)
    tuned = whole_where_split_differs(task, tuned, options, setting.batch_size, env, epochs=epochs, max_steps=steps)
    if tuned is not None:
        return tuned.options, _measured(task, tuned.options, tuned.batch_size, planned), tuned.tuning
    return None, _measured(task, options, setting.batch_size, planned), None


def _measured(task: Task, options: RuntimeOptions, batch_size: int, planned: int | None) -> dict[str, Choice[str]]:
    """The precision a trial measured where ``options`` leave it to auto, as `redline train` measures it:
    a cached trial, else one where the planned run repays it ({} where the precision is given)."""
    trial = "auto" if planned else "on"  # train measures a run long enough to repay it (a stream: unknown)
    insist = "--planned-steps with your run's length measures it where that repays it"
    return measure_auto(task, options, batch_size, planned or 1, read_env(), trial=trial, insist=insist)


def time_runners(
    built: Sequence[Runner | RowProcess],
    window: int,
    rounds: int,
    max_seconds: float,
    tell: Callable[[int], None] = lambda round_: None,
) -> dict[int, tuple[list[float], str]]:
    """Time runners side by side in rotating rounds: each one's window times (by position in ``built``)
    and the error that stopped it ("" if none). A runner that fails stops; the others go on."""
    errors: dict[int, str] = {}
    finished = [0]

    def guarded(index: int, steps: int) -> Callable[[], float]:
        runner = built[index]

        def run() -> float:
            if index in errors:
                return math.nan
            try:
                return runner.run(steps)
            except RedlineError:
                raise
            except Exception as exc:
                errors[index] = row_error(exc)
                return math.nan

        return run

    def settle(index: int) -> Callable[[], float]:
        run = guarded(index, 1)

        def first_of_block() -> float:
            if index == 0:
                tell(finished[0])
                finished[0] += 1
            return run()

        return first_of_block

    here = [r for r in built if isinstance(r, Runner)]  # a row's own process waits for its device itself
    sync = functools.partial(_synchronize, list(dict.fromkeys(torch.device(r.setting.device) for r in here)))
    times, _ = time_steps(
        [guarded(i, window) for i in range(len(built))],
        settle=[settle(i) for i in range(len(built))],
        warmup=0, rounds=rounds, block=1, sync=sync, budget_s=max_seconds,
    )  # fmt: skip
    return {i: (times[i], errors.get(i, "")) for i in range(len(built))}


def _synchronize(devices: list[torch.device]) -> None:
    """Wait for each device the rows run on: a bare ``torch.cuda.synchronize()`` waits for the current GPU only."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()


def _machine(facts: list[DeviceFacts], contention: Contention | None) -> dict[str, Any]:
    """The machine's facts, with how many CPUs other processes kept busy while the bench ran (``others_cpus``; None
    where it cannot be read), and ``busy`` where that left fewer free than the rows' threads need."""
    cpu = probe_device(torch.device("cpu"))
    gpus = [f.name for f in facts if f.type != "cpu"]
    return {
        "cpu": f"{cpu.name} ({cpu.cpu_count} cores, {cpu.cpu_isa})",
        "gpu": ", ".join(gpus) or None,
        "threads": torch.get_num_threads(),
        "others_cpus": round(contention.others, 2) if contention is not None else None,
        "busy": contention.contended if contention is not None else None,
    }
