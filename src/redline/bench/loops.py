"""The training loops a bench times: the naive loop a tutorial writes, and the same step through the Runtime.

Each row trains its own model, built from the same seed, with its own optimizer and its own pass
over the training data (shuffled in the same order for every row, full batches only, a new epoch
when one runs out), so the rows' first losses compare: loading is
part of what is timed, since pinned, non-blocking loading is part of what the Runtime speeds up.
A ``Runner`` runs one step, or a window of steps whose loss it reads once at the end, so the
steps of a window queue on the device as they do in a real run.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from redline.bench.matrix import Setting
from redline.errors import TaskError
from redline.hardware.device import probe_accelerators
from redline.plan import Choice, Plan
from redline.plan.device import resolve_device
from redline.runtime.compile import gave_up_on_model
from redline.runtime.contract import split_batch
from redline.runtime.loss import task_loss
from redline.runtime.optimizer import check_trainable
from redline.runtime.options import PrecisionRequest, RuntimeOptions, Switch
from redline.runtime.runtime import Runtime
from redline.runtime.sampling import data_size
from redline.runtime.transfer import move_to
from redline.runtime.tuned import Tuning
from redline.task import Task


@dataclass
class Runner:
    """One row's model, optimizer and batches, and its training step."""

    setting: Setting
    model: nn.Module
    step_fn: Callable[[Any, Any], torch.Tensor]  # (inputs, targets) already on the device -> loss
    batches: Iterable[Any]
    scope: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    runtime: Runtime | None = None
    first_batch: tuple[Any, Any] | None = None
    first_loss: float | None = None  # of the very first step (its micro-batches' mean), before any update
    micro_steps: int = 1  # micro-batches per optimizer step (a tune's grad_accum): a step is all of them
    optimizer: torch.optim.Optimizer | None = None
    compile_cached: bool | None = None  # its warm-up's compile was served from torch's on-disk caches (compile_cache)
    trial_s: float | None = None  # the seconds auto's precision trial took before the row was built (or read it)
    trial_cached: bool | None = None  # the trial was read from redline's trial cache: a fresh machine pays it
    first_step_s: float | None = None  # its first step's seconds, any compile in it excepted (warm_up times it)
    steps_run: int = 0  # optimizer steps run so far, the warm-up's included
    _iterator: Iterator[Any] | None = field(default=None, repr=False)

    def next_batch(self) -> tuple[Any, Any]:
        """The next full batch, starting another epoch when this one runs out."""
        if self._iterator is not None:
            batch = next(self._iterator, None)
            if batch is not None:
                return split_batch(batch, "train_data")
        self._iterator = iter(self.batches)
        batch = next(self._iterator, None)
        if batch is None:  # a stream that yields fewer samples than a batch: check_sizes cannot know its length
            size = self.setting.batch_size // self.micro_steps
            raise TaskError(
                f"train_data gave no full batch of {size}: a pass over it yields fewer samples\n"
                "hint: pass a batch size no larger than the dataset (--batch-size)"
            )
        return split_batch(batch, "train_data")

    def run(self, steps: int) -> float:
        """Run ``steps`` optimizer steps of ``micro_steps`` micro-batches each; return the last step's loss, the
        mean of its micro-batches' as a row without them has it (read once).

        Whole optimizer steps only, so every timed window holds the same number of them.
        """
        first: list[float] = []
        last: list[torch.Tensor] = []
        with self.scope():
            for index in range(steps * self.micro_steps):
                inputs, targets = self.next_batch()
                loss = self.step_fn(inputs, targets)
                if index % self.micro_steps == 0:  # a new optimizer step
                    last = []
                last.append(loss.detach())
                if self.first_batch is None:
                    self.first_batch = (inputs, targets)
                if self.first_loss is None:  # the whole first batch's loss, as a row without micro-batches has it
                    first.append(float(loss.detach()))
                    if len(first) == self.micro_steps:
                        self.first_loss = sum(first) / len(first)
                if index % self.micro_steps == self.micro_steps - 1:
                    self.steps_run += 1
        return float(torch.stack(last).float().mean()) if last else float("nan")

    def plan(self) -> Plan | None:
        """The Runtime's Plan for this row (None for the naive loop)."""
        return self.runtime.explain() if self.runtime is not None else None

    def compile_seconds(self) -> float | None:
        return self.runtime.compile_seconds if self.runtime is not None else None


PHASES = ("data", "forward", "backward", "optimizer")  # of a training step, as `redline profile` marks them


def phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """Mark a phase of the step in torch.profiler's trace (``redline.NAME``) while a profiler records; else
    nothing, so a timed step pays no marker (one costs microseconds)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(f"redline.{name}")
    return contextlib.nullcontext()


@contextlib.contextmanager
def quiet_failed_ops() -> Iterator[None]:
    """Keep torch from logging an op that fails on fake tensors (a compile tracing a model with a bug) with
    its whole traceback: the row or candidate it fails says the error once. A Ctrl-C (or SIGTERM) that ends the
    block drops the warnings ``_forward_traces_held`` holds."""
    torch_log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, torch_log.disabled = torch_log.disabled, True
    try:
        with _forward_traces_held():
            yield
    finally:
        torch_log.disabled = disabled


@contextlib.contextmanager
def _forward_traces_held() -> Iterator[None]:
    """Hold torch's "Error detected in ...Backward. Traceback of forward call that caused the error" warnings until
    the block ends, and show them then, unless a KeyboardInterrupt ends it.

    AOTAutograd traces a compile's backward in anomaly mode (for its nodes' stack traces), where any error leaving a
    backward node gives that warning: a Ctrl-C during a compile's warm-up pointed the user at a line of their model.
    """
    held: list[tuple[Any, ...]] = []
    show = warnings.showwarning

    def hold(
        message: Warning | str, category: type[Warning], filename: str, lineno: int,
        file: TextIO | None = None, line: str | None = None,
    ) -> None:  # fmt: skip
        said = (message, category, filename, lineno, file, line)
        if str(message).startswith("Error detected in "):
            held.append(said)
        else:
            show(*said)

    warnings.showwarning = hold
    try:
        yield
    except KeyboardInterrupt:
        held.clear()  # the user's own keypress (or a scheduler's SIGTERM), not an error of their model
        raise
    finally:
        warnings.showwarning = show
        for args in held:
            show(*args)


def naive_runner(task: Task, setting: Setting, *, seed: int) -> Runner:
    """The loop a tutorial writes: ``model.to(device)``, a plain DataLoader, eager fp32, ``zero_grad()`` first."""
    device = torch.device(setting.device)
    torch.manual_seed(seed)
    model = task.build_model().to(device)
    check_trainable(model)  # the Runtime's rows refuse it so; torch's optimizer would say "empty parameter list"
    model.train()
    optimizer = task.optimizer(model.parameters())
    loss_fn = task.loss_fn

    def step(inputs: Any, targets: Any) -> torch.Tensor:
        inputs, targets = move_to((inputs, targets), device)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss

    return Runner(setting, model, step, _loader(task, setting.batch_size, seed))


def runtime_runner(
    task: Task,
    setting: Setting,
    *,
    seed: int,
    planned_steps: int | None,
    measured: Mapping[str, Choice[str]] | None = None,
    options: RuntimeOptions | None = None,
    tuning: Tuning | None = None,
) -> Runner:
    """The same step through the Runtime, with the row's precision and compile (or auto's choices);
    ``options`` gives every axis instead (a tune's candidate, a tuned Plan, whose ``tuning`` gives the
    Plan its reasons).

    A step takes the setting's batch: with ``grad_accum`` k, as k micro-batches of a k-th of it.
    """
    options = options or row_options(setting)
    rt = Runtime(options, planned_steps=planned_steps, measured=measured)
    torch.manual_seed(seed)
    model, optimizer = rt.setup(task.build_model(), task.optimizer)
    model.train()
    if tuning is not None:
        rt.adopt_reasons(tuning.reasons, tuning.note)
    # setup() applied the Runtime's process-wide settings (TF32 on a GPU); rows take turns, so each enters its own
    # (and an attention kernel its check chose) for the steps it runs and leaves the process as it found it in
    # between. Paused, not closed: the model keeps the run's checks (auto's channels_last going back to NCHW for a
    # model that cannot run in it, the compile's and the graphs' first steps).
    rt.pause()
    loss_fn = task.loss_fn

    def step(inputs: Any, targets: Any) -> torch.Tensor:
        with phase("forward"), rt.autocast():
            loss = task_loss(loss_fn, model(inputs), targets)  # said as the task's, as train says it
        with phase("backward"):
            rt.backward(loss)
        with phase("optimizer"):
            rt.step(optimizer)
        return loss

    batches = rt.setup_loader(_loader(task, setting.batch_size // options.grad_accum, seed))
    return Runner(
        setting, model, step, batches, scope=rt.turn, runtime=rt, micro_steps=options.grad_accum, optimizer=optimizer
    )


def row_options(setting: Setting) -> RuntimeOptions:
    """The Runtime options of a row: its device, precision and compile (None: auto). CUDA graphs are auto's in the
    auto row, as `redline train` leaves them, and off in an explicit row (an "eager" row runs eager); its device as
    ``as_train_asks``."""
    compile_: Switch = "auto" if setting.compile is None else "on" if setting.compile else "off"
    precision = cast(PrecisionRequest, setting.precision)
    graphs: Switch = "auto" if setting.kind == "auto" else "off"
    return RuntimeOptions(devices=as_train_asks(setting), precision=precision, compile=compile_, cuda_graphs=graphs)


def as_train_asks(setting: Setting) -> str:
    """The devices a row's run is given: "auto" for the auto row of a device the user left to auto, where auto picks
    that device (its Plan then says why, as train's does, not "requested"); else the row's device."""
    if setting.kind != "auto" or setting.asked != "auto":
        return setting.device
    return "auto" if resolve_device("auto", probe_accelerators()).value == setting.device else setting.device


def _loader(task: Task, batch_size: int, seed: int) -> DataLoader[Any]:
    size = data_size(task.train_data)  # None for a stream of unknown length: the loop starts it again when dry
    if size is not None and size < batch_size:
        raise TaskError(
            f"train_data has {size} samples, fewer than the batch size {batch_size}\nhint: pass a smaller --batch-size"
        )
    order = torch.Generator().manual_seed(seed)
    shuffle = size is not None and not isinstance(task.train_data, IterableDataset)  # a stream keeps its own order
    return DataLoader(
        task.train_data, batch_size=batch_size, shuffle=shuffle, drop_last=True, generator=order,
        collate_fn=task.collate_fn,
    )  # fmt: skip


def ran_eagerly(runner: Runner, *, compiled: bool, graphs: bool = False) -> str:
    """Why a row asked to run ``compiled`` (or as CUDA ``graphs``) ran its eager model ("" when it did not):
    torch.compile fell back, the capture failed, or neither could run here. Its timing would be the eager model's,
    which could win by noise and pass for the compiled one's (a tune's candidate, a bench's row)."""
    plan = runner.plan()
    captured = plan.cuda_graphs if plan is not None else None
    if graphs and (runner.runtime is None or not runner.runtime.graphed_forwards):
        why = captured.reason if captured is not None else "no Plan"
        return f"the CUDA graphs never replayed, so it would time the eager model ({why})"
    planned = plan.compile if plan is not None else None
    if not compiled or planned is None:
        return ""
    if not planned.value:
        return f"torch.compile fell back to eager, so it would time the eager model ({planned.reason})"
    gave_up = gave_up_on_model(runner.model)  # past its recompile limit torch runs every later call eagerly
    return f"{gave_up}, so it would time the eager model" if gave_up else ""


def first_step_seconds(runner: Runner) -> float:
    """Run the row's first step and return its seconds, any compile in it excepted (the row's compile seconds say
    that): what a run of the row pays once besides, as kernels are built and memory taken."""
    before = runner.compile_seconds() or 0.0
    started = time.perf_counter()
    runner.run(1)  # it reads the step's loss: the step's work is done, on a GPU too
    elapsed = time.perf_counter() - started
    return max(0.0, elapsed - ((runner.compile_seconds() or 0.0) - before))
