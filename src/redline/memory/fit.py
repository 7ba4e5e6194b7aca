"""Will it fit: an estimate against a device's memory, and the largest batch predicted to fit.

A step's peak grows in a straight line with the batch at a fixed sequence length: the model states
stay, the activations scale. So two traces (the batch asked for and twice it) give the line, the line
gives the largest batch, and one more trace at that batch confirms it (stepping down while it does not).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from torch import nn

from redline.config import non_negative_number, one_of, positive_int, positive_number
from redline.errors import ConfigError, TrainingError, describe_error, invalid
from redline.hardware.catalog import (
    GPUSpec,
    architecture_named,
    gpus_named,
    load_catalog,
    mig_parent,
    names_whole,
    nearest_gpus,
)
from redline.hardware.device import DeviceFacts
from redline.memory.estimate import MemoryEstimate, estimate_memory, meta_model
from redline.parallel.blocks import find_blocks
from redline.parallel.env import read_env
from redline.plan import Choice
from redline.plan.attention import DEFAULT, AttentionRequest, resolve_attention
from redline.plan.precision import resolve_precision
from redline.runtime.measure import recall_auto
from redline.runtime.options import RuntimeOptions
from redline.runtime.sampling import data_size
from redline.runtime.tuned_run import TunedRun, auto_tuned, whole_where_split_differs
from redline.task import Task, require_task

GIB = 2**30
# What a CUDA process cannot hand to tensors: the context and kernels (about 0.5-1.3 GB measured,
# reference notes gpu-choice-and-memory.md 2.5: HF "Model memory anatomy"), kept out of the budget.
CUDA_CONTEXT = GIB
# The caching allocator reserves more than it allocates (rounded blocks, fragmentation): the peak may
# use this share of what is left. On a CPU, a run's resident memory grew past the traced peak by about as much
# (an MLP in fp32: 60 MiB over a 1.1 GiB peak, 25-35 MiB over 0.1-0.2 GiB ones; the interpreter and torch, which
# this process holds too, not counted).
ALLOCATOR_SHARE = 0.95
# The most memory a device is weighed against: 1 PiB, past any GPU or host, where a larger figure overflows
# the byte count (1e308 GiB is infinite bytes).
MAX_MEM_GIB = 2**20
_SEARCHES = 16


@dataclass(frozen=True, kw_only=True)
class Fit:
    """One way to run the step (``label``) weighed against ``available`` bytes: the estimate at the batch asked
    for, whether it fits, and the largest batch predicted to fit (None when not even one sample does), no
    larger than ``cap``: the training set's size, the largest batch a run has. ``trains`` is False where
    train_data holds too few samples for one batch of this way (a sample on each of several GPUs): it has no
    batch to weigh, so ``fits`` is None."""

    label: str
    estimate: MemoryEstimate
    available: int
    largest_batch: int | None
    cap: int | None = None
    trains: bool = True

    @property
    def fits(self) -> bool | None:
        return self.estimate.total <= self.available if self.trains else None

    def to_dict(self) -> dict[str, object]:
        return {
            "label": self.label,
            "estimate": self.estimate.to_dict(),
            "available": self.available,
            "fits": self.fits,
            "largest_batch": self.largest_batch,
            "cap": self.cap,
        }


def available_bytes(mem_gib: float, target: str) -> int:
    """The bytes a training step's tensors may use on a device of ``mem_gib`` (on a CPU, what is free of it): the
    CUDA context left out, and the allocator's share of the rest."""
    usable = mem_gib * GIB - (CUDA_CONTEXT if target == "cuda" else 0)
    return max(int(usable * ALLOCATOR_SHARE), 0)


def largest_batch(
    estimate_at: Callable[..., MemoryEstimate],
    first: MemoryEstimate,
    available: int,
    *,
    multiple: int = 1,
    cap: int | None = None,
    smallest: int | None = None,
) -> int | None:
    """The largest batch (a multiple of ``multiple``: the number of ranks) whose estimate fits ``available``, up
    to ``cap`` (no size past it is traced), and none below ``smallest`` (``multiple`` by default: one sample on
    each rank; more for a model that cannot train on one).

    ``estimate_at(batch_size=B)`` traces one batch size; ``first`` is the estimate already made. Each
    next size comes from the line through the last two traces, kept inside the sizes known to fit and
    known not to (halfway between them when the line points outside): the line is nearly right, but
    the peak can move (from the optimizer step into backward) as the batch grows.
    """
    smallest = multiple if smallest is None else smallest
    points = [(first.batch_size, first.total)]
    fit = first.batch_size if first.total <= available else 0
    if cap is not None:
        cap = max(cap // multiple * multiple, smallest)
        if fit >= cap:  # a smaller batch needs less
            return cap
    over: int | None = None if first.total <= available else first.batch_size
    if over is not None and over <= smallest:  # the smallest batch does not fit: nothing is left to try
        return None
    size = first.batch_size * 2 if fit else max(first.batch_size // 2 // multiple * multiple, smallest)
    for _ in range(_SEARCHES):
        size = size if cap is None else min(size, cap)
        total = estimate_at(batch_size=size).total
        points.append((size, total))
        if total <= available:
            fit = max(fit, size)
        else:
            over = size if over is None else min(over, size)
        if fit == cap:
            break
        if over is not None and over - fit <= max(multiple, fit // 64):  # within 1.5%: as exact as the trace
            break
        size = _next_size(points, available, fit, over, multiple, smallest)
    return fit or None


def _next_size(
    points: list[tuple[int, int]], available: int, fit: int, over: int | None, multiple: int, smallest: int
) -> int:
    (b1, t1), (b2, t2) = points[-2:]
    slope = (t2 - t1) / (b2 - b1) if b2 != b1 else 0.0
    guess = b2 + (available - t2) / slope if slope > 0 else (fit * 2 if over is None else (fit + over) / 2)
    size = max(int(guess) // multiple * multiple, smallest)
    upper = over if over is not None else max(fit, smallest) * 64  # never leap past 64x what fitted
    if size <= fit and fit + multiple < upper:
        size = fit + multiple  # the line says the largest fitting size is found: check the next one up
    elif not fit < size < upper:
        size = (fit + upper) // 2 // multiple * multiple
    return max(size, smallest)


def gpu_facts(name: str) -> tuple[GPUSpec, DeviceFacts]:
    """Find a GPU in the catalog by id (``h100-sxm``), by the name torch reports, or by words of either
    (``RTX 4090``); a clear error for a name that fits no row, or several."""
    if "," in name:
        raise ConfigError(f"--gpu {name!r} names several GPUs; a call weighs one\nhint: one --gpu per call")
    if (card := mig_parent(name)) is not None:
        raise ConfigError(
            f"--gpu {name!r} is a MIG slice of an {card.name}: it holds a share of the card's memory, which the "
            f"catalog does not give\nhint: give the memory torch reports on the slice with --mem-gib (a little under "
            f"the '{name.split('.')[-1]}' of its name)"
        )
    found = gpus_named(name)
    family = architecture_named(name)
    if family is not None:
        ids = ", ".join(s.id for s in found)
        raise ConfigError(
            f"--gpu {name!r} names the {family} architecture, not a card; the catalog's {family} cards: {ids}\n"
            f"hint: name one, e.g. --gpu {found[0].id}, or give the card's memory with --mem-gib"
        )
    if len(found) > 1:
        ids = ", ".join(s.id for s in found)
        raise ConfigError(f"--gpu {name!r} could be any of: {ids}\nhint: name one, e.g. --gpu {found[0].id}")
    if found and not names_whole(name, found[0]):  # "rtx 6000": the Ada card of the catalog, or another
        spec = found[0]
        raise ConfigError(
            f"--gpu {name!r} names {spec.id} ({spec.name}) only in part, and could be a card the catalog lacks\n"
            f"hint: --gpu {spec.id} if that is the card, else give its memory with --mem-gib"
        )
    if not found:
        known = ", ".join(s.id for s in load_catalog())
        near = ", ".join(s.id for s in nearest_gpus(name))
        nearest = f"; nearest: {near}" if near else ""
        raise ConfigError(
            f"--gpu {name!r} is not in the GPU catalog{nearest}; known: {known}\n"
            f"hint: {'name one of the nearest, or ' if near else ''}give its memory instead with --mem-gib"
        )
    spec = found[0]
    # the memory torch reports on the card, as a run there reads it: its datasheet's size less ECC and the driver's
    facts = DeviceFacts(type="cuda", name=spec.name, capability=spec.compute_capability, mem_gib=spec.weighed_gib)
    return spec, facts


def catalog_memory_note(spec: GPUSpec) -> str:
    """Which of a catalog GPU's memory figures a step is weighed against, and why."""
    if spec.usable_gib is None:
        return (
            f"{spec.name} is weighed against the {spec.mem_gib:g} GiB of its datasheet: the catalog holds no reading "
            "of what torch reports on one (redline/hardware/catalog.toml says why)"
        )
    return (
        f"{spec.name} is weighed against the {spec.usable_gib:g} GiB torch reports on one (total_memory), not the "
        f"{spec.mem_gib:g} GB it is sold with: ECC and the driver keep the rest"
    )


@dataclass(frozen=True, kw_only=True)
class MemoryFit:
    """A Task's memory on one device: where it was weighed, and each way to run it (``rows``)."""

    task: str
    device: str
    mem_gib: float
    target: str
    rows: tuple[Fit, ...]
    notes: tuple[str, ...] = ()
    free_gib: float | None = None  # of mem_gib, what was free when weighed (a CPU's), the rows' budget

    def to_dict(self) -> dict[str, object]:
        return {
            "task": self.task,
            "device": self.device,
            "mem_gib": self.mem_gib,
            "free_gib": self.free_gib,
            "target": self.target,
            "rows": [row.to_dict() for row in self.rows],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Weighing:
    """What a step is weighed in: the precision, the attention kernel ("auto": torch's pick per call), and the
    micro-batches a tuned Plan splits each batch into (``grad_accum`` of ``micro_batch``; None: each batch runs
    whole), with a ``note`` that says so."""

    precision: Choice[str]
    attention: Choice[str]
    micro_batch: int | None = None
    grad_accum: int = 1
    note: str = ""


def fit_choices(
    task: Task, precision: str, attention: str, facts: DeviceFacts, *, here: bool, batch_size: int | None
) -> Weighing:
    """What to weigh ``task``'s step in on the device of ``facts``: each axis as given, or as `redline train` runs
    auto there.

    Where the device is this machine's own (``here``), auto is a tuned Plan's where `redline tune` cached one for
    this batch and both axes are auto (as ``--plan auto`` takes it: its precision, kernel and micro-batches, these
    only where a run of the task's own epochs would train split as whole (``whole_where_split_differs``); a
    precision it left to auto is a trial's at its micro-batch), else
    what a trial of the task at this batch measured where one is cached (runtime/measure.py): the precision, and the
    kernel where the trial timed the kernels too. An estimate runs no trial: it is made to learn whether a step fits
    before one runs, and a trial would run steps, on the GPU too. On a GPU weighed from afar (a catalog's, a memory
    size) no trial can have run: the rule, which says so.
    """
    chosen: Choice[str] = resolve_precision(precision, facts)
    kernel = _as_requested(resolve_attention(attention, facts))  # a kernel the device lacks is refused, before a trace
    if precision != "auto":
        return Weighing(chosen, kernel)
    if not here:
        afar = "not measured: a trial runs on this machine's own device only"
        return Weighing(Choice(chosen.value, f"{chosen.reason}; {afar}"), kernel)
    batch = batch_size or task.batch_size
    if attention == "auto":
        options, env = RuntimeOptions(devices=facts.type), read_env()
        found = auto_tuned(task, options, batch, env)
        # as a run of the task's own length takes it: not its micro-batches where split it would train otherwise
        tuned = whole_where_split_differs(task, found, options, batch, env, epochs=task.epochs, max_steps=None)
        if tuned is not None:
            weighing = _tuned(task, tuned, batch, kernel, chosen)
            if tuned is not found:  # its split left out: the note says why, as the run's Plan does
                told = tuned.tuning.reasons["grad_accum"]["reason"]
                weighing = dataclasses.replace(weighing, note=f"the tuned Plan ({tuned.tuning.note}): {told}")
            return weighing
    options = RuntimeOptions(devices=facts.type, attention=cast(AttentionRequest, attention))
    return Weighing(*_recalled(task, options, batch, chosen, kernel))


def _recalled(
    task: Task, options: RuntimeOptions, batch: int, rule: Choice[str], kernel: Choice[str]
) -> tuple[Choice[str], Choice[str]]:
    """The precision, and the kernel, a trial of ``task`` at ``batch`` under ``options`` cached; else the ``rule``'s
    precision, saying no trial was run, and ``kernel``."""
    recalled = recall_auto(task, options, batch, read_env())
    if recalled:
        timed = recalled.get("attention")
        return recalled["precision"], _as_requested(timed) if timed is not None else kernel
    unmeasured = Choice(
        rule.value,
        f"{rule.reason}; not measured: an estimate runs no trial (`redline memory --measure`, or a `redline train` "
        "of this task, measures one, which later estimates use)",
    )
    return unmeasured, kernel


def _tuned(task: Task, tuned: TunedRun, batch: int, kernel: Choice[str], rule: Choice[str]) -> Weighing:
    """The axes of a tuned Plan that change what a step holds, with the tune's reasons. A precision the tune left to
    auto (its budget spent first) is the one a trial cached for the tuned run, at its micro-batch, as
    `redline train` measures it there."""
    rows, when, options = tuned.tuning.reasons, tuned.tuning.note, tuned.options

    def reason(axis: str) -> str:
        return f"{rows[axis]['reason'] or 'tuned'} ({when})" if axis in rows else f"the tuned Plan's ({when})"

    if options.attention != "auto":
        kernel = Choice(str(options.attention), reason("attention"))
    if options.precision != "auto":
        precision = Choice(str(options.precision), reason("precision"))
    else:
        precision, kernel = _recalled(task, options, tuned.batch_size, rule, kernel)
    if tuned.batch_size == batch:
        return Weighing(precision, kernel)
    note = f"the tuned Plan ({when}) splits each batch of {batch} into {options.grad_accum} micro-batches"
    return Weighing(precision, kernel, micro_batch=tuned.batch_size, grad_accum=options.grad_accum, note=note)


def _as_requested(kernel: Choice[str]) -> Choice[str]:
    """The Plan's attention value as a run asks for it: "auto" where torch picks per call."""
    return Choice("auto" if kernel.value == DEFAULT else kernel.value, kernel.reason)


def fit_memory(
    task: Task,
    *,
    device: str,
    mem_gib: float,
    target: str,
    batch_size: int | None = None,
    precision: str = "fp32",
    gpus: int = 8,
    attention: str = "auto",
    grad_accum: int = 1,
    free_gib: float | None = None,
) -> MemoryFit:
    """Weigh ``task``'s step on a device of ``mem_gib`` (of which ``free_gib`` is free now, where given: a CPU's
    memory that other processes do not hold) as it stands, with activation checkpointing, and (on
    GPUs) sharded by FSDP over ``gpus``, its attention on the ``attention`` kernel, each step ``grad_accum``
    micro-batches of ``batch_size`` (the gradients held through them); each with the largest batch
    predicted to fit, up to the training set's size (a batch never holds more, and tracing far past it can take
    long: a batch of items that are not tensors is collated for real)."""
    task = require_task(task)
    batch = task.batch_size if batch_size is None else batch_size
    positive_int("batch_size", batch)  # before any trace: 0 would be traced as 1 sample, or as the ranks' number
    positive_number("mem_gib", mem_gib)
    if mem_gib > MAX_MEM_GIB:
        raise invalid("mem_gib", mem_gib, f"at most {MAX_MEM_GIB} GiB (1 PiB)", "give the device's memory in GiB")
    positive_int("gpus", gpus)
    one_of("target", target, ("cuda", "cpu"))
    if free_gib is not None:
        non_negative_number("free_gib", free_gib)
    available = available_bytes(mem_gib if free_gib is None else min(free_gib, mem_gib), target)
    cap = data_size(task.train_data)
    step_cap = None if cap is None else cap // grad_accum  # a step's micro-batches share the data: none is larger
    model = meta_model(task)
    has_blocks = bool(find_blocks(model))
    one_sample = _one_sample_fails(task, model, precision, target, attention)  # BatchNorm normalises no single value
    per_rank = 2 if one_sample else 1
    ways: list[tuple[str, str, int, bool]] = [("as it stands", "single", 1, False)]
    if has_blocks:
        ways.append(("activation checkpointing", "single", 1, True))
    if target == "cuda" and gpus > 1:
        ways.append((f"FSDP over {gpus} GPUs", "fsdp", gpus, False))
        if has_blocks:
            ways.append((f"FSDP over {gpus} GPUs, checkpointing", "fsdp", gpus, True))
    rows = []
    notes: list[str] = []
    for label, strategy, world, checkpointing in ways:
        estimate_at = functools.partial(
            estimate_memory, task, precision=precision, strategy=strategy, world_size=world,
            activation_checkpointing=checkpointing, target=target, attention=attention, grad_accum=grad_accum,
        )  # fmt: skip
        least = world * per_rank  # the smallest batch a run of this row trains on
        first = estimate_at(batch_size=max(batch, least))
        row_cap = None if step_cap is None else step_cap // world * world  # the ranks share it evenly
        largest = None
        if row_cap is not None and row_cap < least:  # no batch of the data's trains: none is predicted to fit
            each = f"{per_rank} on each of {world} devices" if world > 1 else "one sample cannot train"
            each += f"; a step takes {grad_accum} of them" if grad_accum > 1 else ""
            notes.append(f"{label}: train_data holds {_items(cap or 0)}, and a batch needs at least {least} ({each})")
        else:
            largest = largest_batch(estimate_at, first, available, multiple=world, cap=row_cap, smallest=least)
        trains = row_cap is None or row_cap >= least
        rows.append(Fit(label=label, estimate=first, available=available, largest_batch=largest, cap=row_cap,
                        trains=trains))  # fmt: skip
    notes += _batch_notes(batch, cap, grad_accum)
    weighed = ", ".join(f"{row.estimate.batch_size} ({row.label})" for row in rows if row.estimate.batch_size > batch)
    if one_sample:  # the table's batch column would differ, or its largest batch stop at 2, unexplained
        notes.append(
            f"one sample on a device cannot train ({one_sample}): every row weighs, and predicts, at least 2 samples "
            f"on each device{f'; batch {batch} is weighed as {weighed}' if weighed else ''}"
        )
    elif weighed:  # the table's batch column would differ unexplained
        notes.append(
            f"batch {batch} leaves some of the {gpus} GPUs without a sample, so the FSDP rows weigh a batch of {gpus}, "
            "one sample on each"
        )
    if available == 0 and target == "cpu":
        notes.append(f"of the machine's {mem_gib:g} GiB none is free now: other processes hold it")
    elif available == 0:  # nothing fits, and the table alone would not say why
        notes.append(
            f"a {mem_gib:g} GiB GPU leaves no memory for tensors: the CUDA context takes about "
            f"{CUDA_CONTEXT / GIB:g} GiB of it before any tensor"
        )
    return MemoryFit(
        task=task.name, device=device, mem_gib=mem_gib, free_gib=free_gib, target=target, rows=tuple(rows),
        notes=tuple(notes),
    )  # fmt: skip


def _batch_notes(batch: int, cap: int | None, grad_accum: int) -> list[str]:
    """What the table's batch means, where it is not plainly a step's within the data."""
    notes = []
    if grad_accum > 1:  # the table's batch is not the step's
        whole = f": at most {cap // grad_accum} each, as {grad_accum} of them take all of train_data" if cap else ""
        notes.append(
            f"each step is {grad_accum} micro-batches of {batch}: the batch weighed, and the largest batch predicted, "
            f"are a micro-batch's (a step trains on {grad_accum} times as many samples{whole})"
        )
    if cap is None:  # the largest batch may read far past the stream's end, repeating its items
        notes.append(
            "train_data is a stream with no length, so the largest batch is not capped at its size, as a dataset's "
            "is: a run's batches stop where the stream ends (give it __len__ to cap the prediction)"
        )
    if cap is not None and batch * grad_accum > cap:  # traced as asked (the shapes hold), but no run batches past it
        asked = f"batch {batch} is" if grad_accum == 1 else f"{grad_accum} micro-batches of {batch} are"
        stop = "a run's batches" if grad_accum == 1 else "a step's micro-batches"
        notes.append(
            f"{asked} more than train_data holds ({_items(cap)}): {stop} stop at {cap // grad_accum}, "
            "so the largest batch does too"
        )
    return notes


def _one_sample_fails(task: Task, model: nn.Module, precision: str, target: str, attention: str) -> str:
    """The error a training step of one sample meets, where the model has BatchNorm layers, else "": in training
    BatchNorm refuses a single value per channel (a BatchNorm1d on one sample), which no batch size of the rows
    may ask of it; a BatchNorm2d over an image has values enough, and one sample traces."""
    if not any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules()):
        return ""
    try:
        estimate_memory(task, batch_size=1, precision=precision, target=target, attention=attention)
    except TrainingError as exc:  # an error of the model's own; if a larger batch meets it too, that trace says so
        return describe_error(exc)
    return ""


def _items(count: int) -> str:
    return f"{count} item{'s' * (count != 1)}"
