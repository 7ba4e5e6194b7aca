"""`redline profile`: where a training step's time goes, read from torch.profiler, and what to try.

The step profiled is the one `redline train` would run on the device (auto's Plan: a cached tuned
Plan, else the rules with a measured precision), or the precision and compile asked for. After an
unrecorded warm-up window (compiling, if it compiles) it runs ``steps`` steps under torch.profiler
with each phase marked (``redline.data``: the next batch, loading and the copy to the device;
forward; backward; optimizer), and reads the trace: each phase's host time per step and, on a
GPU, the time of the kernels each phase launched and the share of the steps' wall time in which
the device ran anything. The advice names the flag to try and the command that measures it: a
profile proposes, a measurement decides.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, get_args

import torch
from torch.profiler import ProfilerActivity, schedule

from redline.atomic import HEAD_BYTES, check_output, refuse_replacing, write_or_refuse
from redline.bench.advice import advise
from redline.bench.loops import Runner, phase
from redline.bench.matrix import Setting
from redline.bench.run import check_sizes, task_steps, warm_up
from redline.bench.trace import Breakdown, read_breakdown
from redline.brief import brief
from redline.config import one_of, positive_int, seed_number
from redline.errors import ONE_STEP, TrainingError, invalid
from redline.hardware.device import probe_accelerators, probe_device
from redline.plan import Plan
from redline.plan.device import resolve_device
from redline.plan.precision import fast_precisions
from redline.runtime.contract import users_failure
from redline.runtime.options import CompileMode, RuntimeOptions
from redline.runtime.seed import keeps_rng
from redline.task import Task, require_task

TOP_OPS = 8
STEP_HINT = (
    "check that the dataset's items are (inputs, targets) shaped as the model expects and that loss_fn takes what "
    f"the model returns; `{ONE_STEP}` runs one step and says what each was given "
    "(REDLINE_TRACEBACK=1 prints the whole traceback; in Python it is the error's __cause__)"
)
SWITCH = {"auto": None, "on": True, "off": False}  # compile given as RuntimeOptions takes it
NOT_FINITE = (
    "the loss is not finite (NaN or infinity) at the last recorded step: the model diverged, so these are the times "
    "of a broken run; `redline train` stops at the step where the loss turns so and names it"
)


@dataclass(frozen=True)
class Op:
    """One operator by its own (self) time per step, on the device that did the work."""

    name: str
    self_ms: float
    calls: float  # per step
    share: float  # of every operator's self time


@dataclass(frozen=True)
class Profile:
    """What ``profile()`` found: the settings, the breakdown, the heaviest operators and the advice."""

    task: str
    device: str
    setting: str
    batch_size: int
    plan: Plan
    breakdown: Breakdown
    ops: tuple[Op, ...]
    advice: tuple[str, ...]
    trace: str | None
    flops_per_step: int | None
    peak_memory_bytes: int | None
    peak_memory_kind: str  # "allocated" (a GPU's allocator) or "resident" (the process's resident set)
    ops_on: str  # "gpu" or "host": whose clock the operators' self time was read on
    warmup: int  # the unrecorded steps run first

    def __repr__(self) -> str:
        step = f"{self.breakdown.step_ms:.4g}"
        return brief(
            self, ("task", "device", "setting", "batch_size"), step_ms=step, advice=f"<{len(self.advice)} lines>"
        )

    @property
    def tflops(self) -> float | None:
        """Achieved TFLOP/s over the profiled steps (the profiler's own overhead included); 0.0 where no FLOPs were
        counted (no matmul or convolution), None where they could not be."""
        if self.flops_per_step is None or self.breakdown.step_ms <= 0:
            return None
        return self.flops_per_step / (self.breakdown.step_ms / 1000) / 1e12

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["plan"] = self.plan.to_dict()
        data["tflops"] = self.tflops
        return data


@keeps_rng  # it seeds torch for its own steps: the caller's RNG streams go on as they were
def profile(
    task: Task,
    *,
    devices: str = "auto",
    precision: str | None = None,
    compile: bool | str | None = None,
    compile_mode: str = "default",
    cuda_graphs: str | None = None,
    batch_size: int | None = None,
    steps: int = 10,
    warmup: int = 5,
    planned_steps: int | None = None,
    trace: str | os.PathLike[str] | None = None,
    seed: int = 0,
) -> Profile:
    """Profile ``steps`` training steps of ``task`` after ``warmup`` unrecorded ones; return the breakdown.

    With neither ``precision`` nor ``compile`` (nor a ``compile_mode``) it profiles what `redline train`
    would run (``planned_steps``, default the task's epochs, decides auto's compile); either one
    profiles that setting, the other left to auto (a precision left to auto is measured, as train
    measures it: a cached trial, else one where the planned run repays it). ``compile`` is True, False
    or None (auto), or "on", "off" or "auto". ``compile_mode`` ("reduce-overhead": CUDA graphs, or
    "max-autotune") profiles a compiled step in that mode: it compiles unless ``compile`` is off, which
    refuses it. ``cuda_graphs`` "on" profiles the step with its forward and backward replayed as CUDA graphs
    (runtime/graphs.py), uncompiled: with ``compile`` on it is refused. ``trace`` writes torch.profiler's
    Chrome trace there (``.json``, or ``.json.gz`` compressed) for ui.perfetto.dev or chrome://tracing.
    """
    task = require_task(task)
    compile = _compiles(compile, compile_mode)
    precision = None if precision == "auto" else precision  # said or left out, auto is what `redline train` runs
    positive_int("steps", steps)
    positive_int("warmup", warmup)
    positive_int("batch_size", batch_size, optional=True)
    positive_int("planned_steps", planned_steps, optional=True)
    seed_number("seed", seed)
    size = batch_size or task.batch_size
    check_sizes(task, [size])
    if isinstance(devices, str) and "," in devices:  # a bench's list: a profile is of the one device a run trains on
        first = devices.split(",")[0].strip() or "cpu"
        allowed = "one device: 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
        raise invalid("devices", devices, allowed, f"profile one at a time, e.g. devices={first!r}")
    device = resolve_device(devices, probe_accelerators()).value
    trace_path = Path(trace) if trace is not None else None
    if trace_path is not None:
        if not trace_path.name.endswith((".json", ".json.gz")) and not trace_path.is_dir():
            raise invalid(
                "trace", str(trace_path), "a .json or .json.gz file name (torch.profiler writes Chrome's trace format)",
                f"e.g. trace={str(trace_path.with_suffix('.json'))!r}",
            )  # fmt: skip
        check_output(trace_path, "trace", "trace.json.gz")  # before the steps, after the device: a refusal makes none
        _check_replaceable(trace_path)
    graphs_given = cuda_graphs not in (None, "auto")
    explicit = precision is not None or compile is not None or compile_mode != "default" or graphs_given
    asked = "auto" if devices.strip() == "auto" else ""
    setting = Setting("explicit" if explicit else "auto", device, precision or "auto", compile, size, asked=asked)
    options = None
    if explicit:  # as `redline train` runs these flags: CUDA graphs left to auto unless given
        given: dict[str, Any] = {"precision": precision or "auto", "cuda_graphs": cuda_graphs or "auto"}
        if compile_mode != "default":
            given.update(compile="on", compile_mode=compile_mode)
        elif compile is None:
            given["compile"] = "off" if cuda_graphs == "on" else "auto"  # graphs replay an uncompiled step
        else:
            given["compile"] = "on" if compile else "off"
        # each checked there, its error naming it; the device as the user asked for it, as train would be given it
        options = RuntimeOptions(devices=devices if asked else device, **given)
    planned = planned_steps or task_steps(task, size)
    if torch.device(device).type == "cuda":
        # The profiler started once, empty, before the warm-up captures CUDA graphs: graphs captured before its first
        # start replayed under it with their kernels unrecorded, or faulted (pytorch#75504; torch's docs on CUDA
        # graphs and the profiler, whose workaround this is)
        with torch.profiler.profile():
            pass
    with users_failure(f"profiling task {task.name!r}: its model, loss or optimizer", STEP_HINT):
        runner, memory, flops = warm_up(task, setting, warmup, planned, seed, options=options)
    with tempfile.TemporaryDirectory(prefix="redline-profile-") as scratch:
        written = Path(scratch) / "trace.json"
        with users_failure(f"profiling task {task.name!r}: a recorded step", STEP_HINT):
            averages, loss = _record(runner, steps, written, cuda=torch.device(device).type == "cuda")
        events = json.loads(written.read_text(encoding="utf-8")).get("traceEvents", [])
        breakdown = read_breakdown(events)
        plan = runner.plan()
        assert plan is not None  # a Runtime's row
        gpu = device.startswith("cuda")
        compiled = plan.compile is not None and bool(plan.compile.value)
        if setting.kind == "explicit":  # the label says what ran: the axes left to auto as the Plan resolved them
            setting = replace(setting, precision=plan.precision.value, compile=compiled)
        captured = plan.cuda_graphs is not None and bool(plan.cuda_graphs.value)
        overhead = runner.runtime is not None and runner.runtime.options.compile_mode == "reduce-overhead"
        graphs = (compiled and overhead) or captured
        fast = fast_precisions(probe_device(torch.device(device)))
        advice = advise(
            breakdown, plan, env=os.environ, anomaly=torch.is_anomaly_enabled(), gpu=gpu, batch_size=size,
            graphs=graphs, fast=fast, optimizer=stepped_by(runner.optimizer),
        )  # fmt: skip
        if loss is not None and not bool(torch.isfinite(loss.detach()).all()):  # as the bench marks such a row
            advice.insert(0, NOT_FINITE)
        found = Profile(
            task=task.name,
            device=device,
            setting=setting.name
            + (f", {compile_mode}" if compile_mode != "default" else "")
            + (", CUDA graphs" if captured else ""),
            batch_size=size,
            plan=plan,
            breakdown=breakdown,
            ops=top_ops(averages, breakdown.steps, cuda=breakdown.device_busy is not None),
            advice=tuple(advice),
            trace=str(trace_path) if trace_path is not None else None,
            flops_per_step=flops,
            peak_memory_bytes=memory.peak,
            peak_memory_kind=memory.kind,
            ops_on="gpu" if breakdown.device_busy is not None else "host",
            warmup=warmup,
        )
        if trace_path is not None:  # last: a stop before it leaves any earlier trace there as it was
            _keep(written, trace_path)
    return found


def stepped_by(optimizer: Any) -> str | None:
    """How ``optimizer`` steps its tensors, as built: "fused", "foreach", or None (one at a time, or not known)."""
    defaults = getattr(optimizer, "defaults", None) or {}
    return "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else None


def _compiles(compile: bool | str | None, compile_mode: str) -> bool | None:
    """Whether the profiled step compiles (None: auto decides), ``compile`` checked against ``compile_mode``.

    A mode other than the default is a compiled step's: it compiles, and with compile off it is refused
    rather than profiled as an eager step that a label calls compiled.
    """
    if isinstance(compile, str) and compile.lower() in SWITCH:
        compile = SWITCH[compile.lower()]
    if compile is not None and not isinstance(compile, bool):  # "off" is truthy: it would compile
        raise invalid("compile", compile, "True, False or None (auto), or 'on', 'off' or 'auto'", "e.g. compile=True")
    one_of("compile_mode", compile_mode, get_args(CompileMode))
    if compile_mode == "default":
        return compile
    if compile is False:
        raise invalid(
            "compile_mode", compile_mode, "'default' when compile is off (a mode is how a compiled step runs)",
            f"pass compile='on' to profile the step compiled in {compile_mode}, or compile_mode='default' for an eager "
            "step",
        )  # fmt: skip
    return True


def _record(runner: Runner, steps: int, path: Path, *, cuda: bool) -> tuple[Any, torch.Tensor | None]:
    """Run one unrecorded step and ``steps`` recorded ones under torch.profiler; write the trace to ``path``
    and return its operator averages and the last step's loss."""
    activities, loss = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])], None
    recorder = torch.profiler.profile(
        activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)
    )
    with _without_profiler_chatter():
        recorder.start()
    try:
        with runner.scope():
            for index in range(steps + 1):  # the first is the profiler's own warm-up, left out of the trace
                for _ in range(runner.micro_steps):  # a tuned Plan's micro-batches make one step
                    with phase("data"):
                        inputs, targets = runner.next_batch()
                    loss = runner.step_fn(inputs, targets)
                if index in (0, steps):  # the recorded steps start on an idle device and end when it is done
                    _wait_for_device(torch.device(runner.setting.device))
                with _without_profiler_chatter():
                    recorder.step()  # after the last, the trace is complete
    except BaseException:  # Ctrl-C mid-operator, say: stopping then can fail itself, and would be said in its place
        with contextlib.suppress(Exception), _without_profiler_chatter():
            recorder.stop()
        raise
    with _without_profiler_chatter():
        recorder.stop()
    recorder.export_chrome_trace(str(path))
    return recorder.key_averages(), loss


def _wait_for_device(device: torch.device) -> None:
    """Wait for the work queued on ``device``: the host runs steps ahead of a GPU, so without this the
    recorded steps' time would be the host's launching alone (and TFLOP/s above what the device did)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _check_replaceable(path: Path) -> None:
    """Refuse a trace ``path`` that holds a file other than a trace (a run's summary.json, a bench's result): an
    earlier trace there is replaced, anything else would be lost."""
    refuse_replacing(path, "trace", kind="Chrome trace", holds=_is_trace, example="trace.json.gz")


def _is_trace(path: Path) -> bool:
    """Whether ``path`` holds a Chrome trace (gzipped for ``.gz``), as torch.profiler writes one."""
    with gzip.open(path) if path.name.endswith(".gz") else path.open("rb") as file:
        head = file.read(HEAD_BYTES)
    return b'"traceEvents"' in head or b'"schemaVersion"' in head


def _keep(written: Path, path: Path) -> None:
    """Put the trace at ``path`` (compressed for ``.gz``), atomically; an existing file is replaced whole."""
    data = written.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    hint = f"pass --trace with a path you can write (the directory of {path} refused it)"

    def write(tmp: Path) -> None:
        tmp.write_bytes(data)

    write_or_refuse(path, write, error=TrainingError, hint=hint)


_CHATTER = re.compile(rb"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def _without_profiler_chatter() -> Iterator[None]:
    """Drop the lines the profiler's C++ side prints to stderr as it starts and stops (``USDT:... profiler_start``);
    anything else written meanwhile goes on to stderr.

    Without a stderr (a process started with it closed, where Python sets ``sys.stderr`` to None) there
    is nothing to keep clean: the profile runs as it is.
    """
    if sys.stderr is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = b"".join(line for line in caught.read().splitlines(keepends=True) if not _CHATTER.match(line))
            if kept:
                sys.stderr.write(kept.decode(errors="replace"))
                sys.stderr.flush()


def top_ops(averages: Any, steps: int, *, cuda: bool) -> tuple[Op, ...]:
    """The operators with the most self time per step: on the device under CUDA, else on the host."""
    rows = []
    for average in averages:
        if getattr(average, "is_user_annotation", False) or average.key.startswith("ProfilerStep#"):
            continue  # a marked span, not work
        self_us = float(average.self_device_time_total if cuda else average.self_cpu_time_total)
        if self_us > 0:
            rows.append((average.key, self_us, average.count))
    total = sum(us for _, us, _ in rows) or 1.0
    rows.sort(key=lambda row: -row[1])
    return tuple(Op(name, us / steps / 1000, count / steps, us / total) for name, us, count in rows[:TOP_OPS])
