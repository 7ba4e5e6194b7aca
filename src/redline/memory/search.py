"""The largest batch that runs a full training step on this device, found by running it.

    search = redline.find_batch_size(task)          # up to max_batch_size=..., or the dataset's size
    print(search.largest, search.reason)

Sizes double from ``start`` until one runs out of memory (or reaches the cap), then a binary search
between the largest size that fitted and the smallest that did not finds the boundary; a start that
is already too large halves until a size fits. ``next_batch_size`` plans it, a pure function of what
was tried. Each try (a probe) builds a fresh model and Runtime and runs ``steps`` real training steps
(forward, loss, backward, optimizer step) on a batch of that size from the Task's own data: the
second step is the steady state, with the optimizer's state allocated. An out-of-memory ends the
probe, and everything it held is freed before the next one starts. On a CPU, whose out-of-memory is the
kernel killing the process, a size predicted past the process's memory is not run (memory/host.py).

Under several processes every rank probes the same size and the ranks agree after building the model,
after wrapping it and after every step, so a size fits only if it fitted on every rank, and every rank
returns the same search. The gradients are not all-reduced during a probe (DDP's ``no_sync``): a rank
out of memory mid-backward would leave the others waiting in a collective it never joins. DDP's buckets
are allocated all the same, and the gradients then take memory of their own beside them: the answer
errs on the safe side by at most a copy of the gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from redline.config import positive_int
from redline.errors import (
    ConfigError,
    OutOfMemory,
    RedlineError,
    TaskError,
    Terminated,
    TrainingError,
    describe_error,
    interrupting_signal,
    invalid,
)
from redline.memory.host import NOT_RUN, HostGuard
from redline.memory.meta import built_for_real
from redline.memory.sample import largest_told, real_batch
from redline.parallel.collectives import gather_objects, is_collective_failure, run_on_rank0
from redline.parallel.env import DistEnv, join_process_group, read_env
from redline.plan import Choice
from redline.runtime.contract import check_loss, split_batch, user_code, user_line
from redline.runtime.measure import measure_auto, recall_auto
from redline.runtime.oom import free_memory, is_oom
from redline.runtime.options import RuntimeOptions
from redline.runtime.runtime import Runtime
from redline.runtime.sampling import data_size
from redline.runtime.seed import capture_rng, restore_rng
from redline.runtime.tuned_run import auto_tuned
from redline.task import Task, require_task

Tried = tuple[int, bool, str]  # a batch size, whether it fitted, and the out-of-memory error if not ("")


class SearchStopped(Terminated):
    """Ctrl-C (or SIGTERM, where a command takes it so) during ``find_batch_size``; ``tried`` holds the sizes run."""

    def __init__(self, signum: int, tried: tuple[Tried, ...]) -> None:
        super().__init__(signum)
        self.tried = tried

    def __str__(self) -> str:  # not the bare signal number a KeyboardInterrupt's args would print
        fitted = [size for size, fits, _ in self.tried if fits]
        ran = ", ".join(f"{size} ({'fits' if fits else 'out of memory'})" for size, fits, _ in self.tried)
        told = f"after batch sizes {ran}" if ran else "before any batch size was tried"
        best = f"; the largest that fitted: {max(fitted)}" if fitted else ""
        return f"find_batch_size stopped by {signal.Signals(self.signum).name} {told}{best} (.tried holds them)"


def next_batch_size(tried: Sequence[tuple[int, bool]], *, start: int, cap: int | None = None) -> int | None:
    """Return the next batch size to try after ``tried`` ((size, fitted) in order), or None when the search is done.

    Double from ``start`` while sizes fit, up to ``cap``; after a failure, halve while nothing has
    fitted yet; once there is a largest success below a failure, bisect between them until they are
    neighbours. The answer is the largest size that fitted (none when size 1 failed).
    """
    if not tried:
        return start if cap is None else min(start, cap)
    largest = max((size for size, fitted in tried if fitted), default=0)
    failed_above = [size for size, fitted in tried if not fitted and size > largest]
    if not failed_above:  # nothing failed above the largest that fitted: keep doubling, up to the cap
        if cap is not None and largest >= cap:
            return None
        return largest * 2 if cap is None else min(largest * 2, cap)
    smallest_failure = min(failed_above)
    if not largest:  # the start was already too large: halve until something fits
        return smallest_failure // 2 or None
    middle = (largest + smallest_failure) // 2 if cap is None else min((largest + smallest_failure) // 2, cap)
    return middle if middle > largest else None


def search_reason(tried: Sequence[Tried], cap: int | None, *, cap_given: bool = True) -> str:
    """One line saying what the search found and what stopped it; ``cap_given``: the caller set the cap (else it
    is the dataset's size, a CPU's default)."""
    fitted = [size for size, ok, _ in tried if ok]
    if not fitted:
        first = min(tried, key=lambda t: t[0]) if tried else (1, False, "")
        return f"nothing fits: batch size {first[0]} ran out of memory ({first[2]})"
    largest = max(fitted) if cap is None else min(max(fitted), cap)  # past the cap only where a stream ended
    failures = [(size, error) for size, ok, error in tried if not ok and size > largest]
    if not failures or largest == cap:
        if not cap_given:
            return f"{largest} fits: the dataset's size ({cap}), the largest batch a run has, stopped the search"
        return f"{largest} fits: the cap (max_batch_size={cap}) stopped the search"
    size, error = min(failures)
    if error.startswith(NOT_RUN):  # weighed against a CPU's memory, not run
        return f"{largest} fits; {size} {error}"
    return f"{largest} fits; {size} ran out of memory ({error})"


@dataclass(frozen=True, kw_only=True)
class BatchSearch:
    """What ``find_batch_size`` found: the largest batch that trained, every size tried, and the conditions.

    ``largest`` is None when not even a batch of one fitted. Under several processes it is each
    process's own batch (the global batch is ``world_size`` times it). ``notes`` say what the figure
    assumes (compile off, repeated samples, the cap's origin, the split over processes).
    """

    largest: int | None
    tried: tuple[Tried, ...]
    device: str
    precision: str
    precision_reason: str  # the Plan's reason: auto's is measured by a trial, as `redline train` runs it
    seconds: float
    reason: str
    cap: int | None
    steps: int
    world_size: int = 1
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Return the search as JSON-ready data."""
        data = asdict(self)
        data["tried"] = [{"batch_size": s, "fitted": ok, "error": error} for s, ok, error in self.tried]
        data["notes"] = list(self.notes)
        return data


def check_start(start: int, cap: int | None, *, capped: bool) -> None:
    """Refuse a first size past the search's cap: ``max_batch_size`` where ``capped``, else the dataset's size."""
    if cap is not None and start > cap:
        where = f"max_batch_size={cap}" if capped else "the dataset's size, the largest batch a run has"
        hint = f"pass start={cap} or less, or max_batch_size={start} or more"
        raise invalid("start", start, f"at most {cap} ({where})", hint)


def find_batch_size(
    task: Task,
    *,
    options: RuntimeOptions | None = None,
    start: int = 1,
    max_batch_size: int | None = None,
    steps: int = 2,
) -> BatchSearch:
    """Return the largest batch that runs ``steps`` full training steps of ``task`` on the Runtime's device.

    The Runtime follows ``options`` (device, precision, layout), with compile off: compiling changes
    the memory a step needs and would compile again for every size. An "auto" precision is the one a
    run of the task measures (runtime/measure.py: a cached trial at the task's batch size, else one
    run now), and a tuned Plan's precision, kernel and layout where `redline tune` cached one, so the answer
    is for the run `redline train` makes. The cap defaults to the dataset's
    size (a stream's where it has ``__len__``), the largest batch a run has. A CPU needs it: the operating
    system kills the process long before torch raises, so a stream of no length needs ``max_batch_size``
    there; on a GPU an out-of-memory error stops the doubling of such a stream, or its end. An error other than
    out-of-memory stops the search (a TrainingError naming the size when it came from the model or loss).
    Under ``redline launch`` every rank must call it.
    """
    task = require_task(task)
    positive_int("start", start)
    positive_int("max_batch_size", max_batch_size, optional=True)
    positive_int("steps", steps)
    given = RuntimeOptions.build(options)
    options = dataclasses.replace(given, compile="off", compile_mode="default", grad_accum=1)  # reset, not asked for
    began = time.perf_counter()
    device = Runtime(options).device  # resolves the device; starts nothing
    cap, notes = _cap(task.train_data, device, max_batch_size)
    check_start(start, cap, capped=max_batch_size is not None)
    notes.append("compile off: a compiled step needs other memory, and each size would compile again")
    env = read_env()
    tried: list[Tried] = []
    smallest = 1  # the smallest batch the model trains on
    # a CPU's out-of-memory kills the process: a size predicted past its memory is not run (one process: ranks
    # that weighed apart could leave one waiting in a collective)
    guard = HostGuard() if device.type == "cpu" and env.world_size == 1 else None
    short: set[int] = set()  # the samples a probe had when the data held fewer than its batch
    saved = capture_rng()  # each probe draws a model's weights (and applies a seed): the caller's streams stay put
    # one process group for every probe's Runtime; a training step needs autograd, whatever the caller's mode
    try:
        order, told = largest_told(task.train_data)  # a batch padded to its longest item: the largest make the peak
        notes += told  # (read within the RNG's save: an item's augmentation draws from it)
        with _told(tried), join_process_group(env, device.type), torch.inference_mode(False), torch.enable_grad():
            options, measured, precision = _as_trained(task, given, options, env, cap, notes)
            while (size := next_batch_size([(s, ok) for s, ok, _ in tried], start=start, cap=cap)) is not None:
                if size < smallest:  # halved below the smallest batch the model trains on: nothing fits
                    break
                if guard is not None and (refused := guard.refuse(size)):
                    tried.append((size, False, refused))
                    continue
                try:
                    error, samples = _probe(task, options, measured, size, steps, order)
                except TrainingError as exc:  # BatchNorm refuses one value per channel: no run trains on 1 sample
                    if size != 1 or cap == 1 or isinstance(exc, OutOfMemory) or not _batch_norm(task):
                        raise
                    # every rank raised alike, so every rank starts again at 2, or, halved down to 1 from sizes
                    # out of memory, stops there: nothing fits
                    start = smallest = 2
                    how = "stopped" if tried else "began"
                    notes.append(f"batch size 1 cannot train ({describe_error(exc)}): the search {how} at 2")
                    continue
                tried.append((size, not error, error))
                if guard is not None:
                    guard.ran(size, not error)
                if cap is None and 0 < samples < size:  # a stream of no length ended: no run has a larger batch
                    cap = samples
                    notes.append(
                        f"train_data is a stream that ended after {samples} items: no run has a larger batch, so the "
                        "search stopped there"
                    )
                elif 0 < samples < size:
                    short.add(samples)
    finally:
        restore_rng(saved)
    if short:
        notes.append(
            f"train_data gave {max(short)} samples: larger batches repeat them (memory follows shapes, not values)"
        )
    if env.world_size > 1:
        notes.append(
            f"per process: each of the {env.world_size} processes ran a batch of this size (the global batch is "
            f"{env.world_size} times it); gradients were not all-reduced, which errs on the safe side"
        )
    fitted = [s for s, ok, _ in tried if ok]
    return BatchSearch(
        largest=(max(fitted) if cap is None else min(max(fitted), cap)) if fitted else None,
        tried=tuple(tried),
        device=str(device),
        precision=precision.value,
        precision_reason=precision.reason,
        seconds=time.perf_counter() - began,
        reason=search_reason(tried, cap, cap_given=max_batch_size is not None),
        cap=cap,
        steps=steps,
        world_size=env.world_size,
        notes=tuple(notes),
    )


def _as_trained(
    task: Task, given: RuntimeOptions, options: RuntimeOptions, env: DistEnv, cap: int | None, notes: list[str]
) -> tuple[RuntimeOptions, dict[str, Choice[str]], Choice[str]]:
    """The options, the measured choices and the precision the probes run ``task`` in, as `redline train` runs it.

    Where ``given`` left every tuned axis to auto and `redline tune` cached a Plan, its axes that change what a
    step holds (precision, attention kernel, layout) replace ``options``'; its micro-batches do not (the search
    finds the batch one step holds), and ``notes`` says so. An "auto" precision left is the one a run measures
    (``_measured``: at the task's batch size, a tuned run's at its micro-batch; past the cap, at the cap)."""
    tuned = auto_tuned(task, given, task.batch_size, env)
    if tuned is None:
        measured = _measured(task, options, task.batch_size, env, cap, notes)  # {} for a precision given
        return options, measured, Runtime(options, measured=measured).explain().precision
    # a precision the tune left to auto is measured as train measures the tuned run: at its micro-batch
    measured = _measured(task, tuned.options, tuned.batch_size, env, cap, notes)
    options = dataclasses.replace(options, **{axis: getattr(tuned.options, axis) for axis in _TUNED_MEMORY})
    planned = Runtime(options, measured=measured)
    planned.adopt_reasons(tuned.tuning.reasons, tuned.tuning.note)
    precision = planned.explain().precision
    said = f"precision {precision.value}, attention {options.attention}, channels_last {options.channels_last}"
    note = f"run in the tuned Plan's {said} ({tuned.tuning.note}), as `redline train` runs them"
    if tuned.options.grad_accum > 1:
        note += f"; not its {tuned.options.grad_accum} micro-batches a step: the search finds what one step holds"
    notes.append(note)
    return options, measured, precision


def _measured(
    task: Task, options: RuntimeOptions, batch: int, env: DistEnv, cap: int | None, notes: list[str]
) -> dict[str, Choice[str]]:
    """The choices of an "auto" precision for a run of ``batch`` (global): the trial a run cached at that batch, else
    one run now, at the search's ``cap`` (per process) where the batch is past it, and ``notes`` says so.

    The search runs nothing past its cap (a CPU's out-of-memory kills the process), the precision trial before it
    included: a task's batch of 4096 under ``max_batch_size=4`` is tried at 4 instead.
    """
    trial_batch = batch if cap is None else min(batch, cap * env.world_size)
    if trial_batch == batch:
        return measure_auto(task, options, batch, 1, env, trial="on")
    # a trial cached at the run's own batch ran no step here: it is what `redline train` takes
    cached = run_on_rank0(lambda: recall_auto(task, options, batch, env), "reading the cached precision trial")
    if cached:
        return cached
    measured = measure_auto(task, options, trial_batch, 1, env, trial="on")
    if measured:
        notes.append(
            f"the precision trial ran at batch {trial_batch}, the search's cap, not at the run's {batch}, which "
            f"the cap keeps from running here; `redline train` measures at {batch} and may choose otherwise"
        )
    return measured


@contextlib.contextmanager
def _told(tried: list[Tried]) -> Iterator[None]:
    """Inside, a Ctrl-C (or a SIGTERM taken as one) is a SearchStopped holding the sizes ``tried`` so far."""
    try:
        yield
    except KeyboardInterrupt as stop:
        raise SearchStopped(interrupting_signal(stop), tuple(tried)) from stop


def _cap(data: Dataset[Any], device: torch.device, max_batch_size: int | None) -> tuple[int | None, list[str]]:
    """The largest size to try, and a note when it is the default: the dataset's size, the largest batch a run
    has (as the estimate stops there too). A CPU needs it, a GPU is spared a search past any run's batch."""
    if max_batch_size is not None:
        return max_batch_size, []
    size = data_size(data)
    if size is None:
        if device.type != "cpu":
            return None, []  # a stream has no size: the device's out-of-memory, or the stream's end, ends the doubling
        raise ConfigError(
            "on a CPU the search needs max_batch_size: the operating system kills a process out of memory long "
            "before torch raises, and train_data is a stream of no stated length (no __len__) to stand in\n"
            "hint: pass max_batch_size=N (redline memory --measure --max-batch-size N), or give the stream a __len__"
        )
    if size == 0:  # a stream saying it is empty: no batch to try, whatever the start
        raise TaskError("train_data holds no item: there is nothing to build a batch from\nhint: check the dataset")
    if device.type == "cpu":
        return size, [
            f"max_batch_size defaults to the dataset's size ({size}) on a CPU, whose out-of-memory kills the process"
        ]
    return size, [
        f"max_batch_size defaults to the dataset's size ({size}), the largest batch a run has: pass one to try past it"
    ]


def _probe(
    task: Task,
    options: RuntimeOptions,
    measured: Mapping[str, Choice[str]],
    size: int,
    steps: int,
    order: Sequence[int] | None = None,
) -> tuple[str, int]:
    """Run ``steps`` training steps at ``size``; return the out-of-memory error ("" if it fitted) and the samples used.

    The ranks agree after every stage: the model built and placed (each rank on its own), the model
    wrapped and the batch placed (DDP's constructor runs collectives), then each step. Each runs the
    same stages, so none waits in a collective that a rank which failed before it skips. Whatever the
    probe held is freed before it returns.
    """
    probe = _Probe(task, options, measured, size, order)
    device = probe.rt.device
    try:
        for stage in range(_PLACE, steps + 1):
            oom, error = probe.run(stage)
            failure = _agree(size, oom, error)
            if failure:
                return failure, probe.samples
        return "", probe.samples
    finally:
        probe.rt.close()
        del probe  # the only reference to its Runtime, model, optimizer state and batch
        free_memory(device)


_TUNED_MEMORY = ("precision", "attention", "channels_last")  # a tuned Plan's axes that change what a step holds
_PLACE, _WRAP = -1, 0  # a probe's stages before its training steps (1, 2, ...)


class _Probe:
    """One try of a batch size: a fresh Runtime, model, optimizer and batch, all dropped with it."""

    def __init__(
        self,
        task: Task,
        options: RuntimeOptions,
        measured: Mapping[str, Choice[str]],
        size: int,
        order: Sequence[int] | None = None,
    ) -> None:
        self.task, self.size, self.order = task, size, order
        self.rt = Runtime(options, measured=measured)
        self.samples = 0
        self.placed: nn.Module | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.batch: tuple[Any, Any] | None = None

    def run(self, stage: int) -> tuple[str, Exception | None]:
        """Run a stage (_PLACE, _WRAP or a training step); return the out-of-memory error's line, or the other error."""
        try:
            if stage == _PLACE:
                self.rt.start()  # before the model is built, so a seed applies to its weights
                self.placed = built_for_real(self.task, out_of_memory_passes=True).to(self.rt.device)
            elif stage == _WRAP:
                self._wrap()
            else:
                self._step(stage)
        except Exception as exc:  # told apart here, acted on by the caller once every rank knows
            if is_collective_failure(exc):
                raise
            return (describe_error(exc), None) if is_oom(exc) else ("", exc)
        return "", None

    def _wrap(self) -> None:
        rt, task = self.rt, self.task
        assert self.placed is not None
        self.model, self.optimizer = rt.setup(self.placed, task.optimizer)
        if rt.env.distributed and rt.strategy is not None and rt.strategy.name == "fsdp":
            raise ConfigError(
                "the batch-size search cannot run under FSDP: its forward gathers weights from every rank, so "
                "one rank out of memory would leave the others waiting\nhint: search with strategy='ddp' when "
                "the model fits on one device, or find the batch size by hand"
            )
        self.model.train()
        batch, self.samples = real_batch(task.train_data, self.size, task.collate_fn, self.order)
        if self.order is not None:  # the largest of the items read, repeated past them: short only of a short dataset
            self.samples = min(self.size, len(task.train_data))  # type: ignore[arg-type]  # an order: a length
        self.batch = split_batch(rt.to_device(batch), "train_data")

    def _step(self, step: int) -> None:
        rt, task = self.rt, self.task
        assert self.model is not None and self.optimizer is not None and self.batch is not None
        inputs, targets = self.batch
        with self._local_gradients(), user_code(f"batch size {self.size}, step {step}", inputs, targets):
            with rt.autocast():
                loss = check_loss(task.loss_fn(self.model(inputs), targets), training=True)
            rt.backward(loss)
        rt.step(self.optimizer)

    def _local_gradients(self) -> contextlib.AbstractContextManager[Any]:
        """Under several processes, keep the gradients local: no collective in the step that one rank could miss."""
        if self.rt.strategy is None or self.model is None or not self.rt.env.distributed:
            return contextlib.nullcontext()
        return self.rt.strategy.gradient_sync(self.model, False)


def _batch_norm(task: Task) -> bool:
    """Whether the Task's model has BatchNorm layers, which in training refuse one sample of one value per channel."""
    try:
        model = task.outline()  # built for real where its factory reads a value (it runs here anyway)
    except Exception:  # a factory that fails: the error the search is handling says so, with its line
        return False
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _agree(size: int, oom: str, error: Exception | None) -> str:
    """Every rank's outcome of a step, the same on all: "" when each fitted, else the first rank's error.

    Another error than out-of-memory stops the search on every rank, each naming the rank that had it.
    """
    outcomes = gather_objects((oom, describe_error(error) if error is not None else ""))
    if error is not None:
        if isinstance(error, RedlineError):
            raise error
        raise TrainingError(f"batch size {size}: {describe_error(error)}{user_line(error)}") from error
    for rank, (_, other) in enumerate(outcomes):
        if other:
            raise TrainingError(f"batch size {size}: rank {rank} failed: {other}\nhint: its own output shows where")
    failed = [(rank, text) for rank, (text, _) in enumerate(outcomes) if text]
    if not failed:
        return ""
    rank, text = failed[0]
    return text if len(outcomes) == 1 else f"rank {rank}: {text}"
