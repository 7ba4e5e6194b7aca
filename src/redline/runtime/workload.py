"""What a trial of a run's "auto" precision times, besides the task: the device, the local batch, the candidates, the
layout and attention kernels each is timed in, and whether the run shards its model (``Workload``); and the task's
fingerprint and the worker's device that key it (runtime/measure.py runs and caches the trial)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from redline.errors import describe_error
from redline.hardware.device import DeviceFacts, probe_accelerators, probe_device
from redline.parallel.env import DistEnv
from redline.plan import Choice
from redline.plan.attention import plan_kernel
from redline.plan.device import resolve_worker_device
from redline.plan.layout import has_conv2d, resolve_channels_last
from redline.plan.precision import PrecisionName, fast_precisions
from redline.plan.strategy import will_shard
from redline.runtime.attention import AttentionCall, attention_kernels
from redline.runtime.contract import users_failure
from redline.runtime.kernel_check import KEEP, preferred, time_against_pick
from redline.runtime.layout import falls_back
from redline.runtime.options import RuntimeOptions
from redline.runtime.precision import AUTOCAST_DTYPES
from redline.runtime.seed import capture_rng, restore_rng
from redline.runtime.trial import form, form_parts
from redline.task import Task

# The most seconds a trial's timing of the model's attention calls alone may take (``picked_forms``): each kernel's
# four passes of the calls cost less than the thirteen whole steps a trial of that kernel's form would.
KERNELS_TRIAL_S = 10.0


@dataclass(frozen=True)
class Workload:
    """What a trial times, besides the task: on which device, at which batch, which candidates, in which layout."""

    device: torch.device
    facts: DeviceFacts
    local_batch: int
    candidates: list[PrecisionName]  # the reduced precisions: each is timed, and with each attention kernel (below)
    asked_layout: str  # the run's channels_last ("auto", "on", "off"): each precision is timed in the layout it gets
    world_size: int
    attention: str  # the run's request: "auto" times the kernels (``kernel_forms``); a kernel named runs every step
    shards: Callable[[], bool] = lambda: False  # whether the run shards its model (``sharded``), found when asked
    deterministic: bool = False  # on a CPU a deterministic run keeps its optimizer as given, untimed: the copies too

    @functools.cached_property
    def sharded(self) -> bool:
        """FSDP, asked or auto's: the run keeps its optimizer as given and its model NCHW, and the trial's copies do
        so. Found where a trial or its cache needs it: "auto" may build the model's outline to count its size."""
        return self.shards()

    @property
    def channels_last(self) -> str:
        return "off" if self.sharded else self.asked_layout  # FSDP's models stay NCHW (plan/layout.py)

    @property
    def fallback(self) -> bool:
        """Whether the run goes back to NCHW where its model fails in NHWC (runtime/layout.py): the trial too."""
        return falls_back(self.channels_last, self.world_size)

    def layout(self, model: nn.Module) -> Callable[[str], bool]:
        """Whether the run would lay ``model`` out channels_last under each precision."""
        convolutional = has_conv2d(model)
        return lambda precision: (
            resolve_channels_last(self.channels_last, self.facts, has_conv2d=convolutional, precision=precision).value
        )

    def choices(self, chosen: Choice[str], *, kernels: bool) -> dict[str, Choice[str]]:
        """The Runtime's measured axes from the trial's choice of form: the precision, and the attention kernel where
        the trial timed ``kernels`` ("default": torch's pick per call), each with the trial's reason."""
        precision, kernel = form_parts(chosen.value)
        found = {"precision": Choice(precision, chosen.reason)}
        if kernels:
            found["attention"] = Choice(plan_kernel(kernel), chosen.reason)
        return found

    def kernel_forms(self, calls: Sequence[AttentionCall]) -> list[str]:
        """Each reduced precision with every other attention kernel that takes the model's ``calls`` in it.

        torch's pick can be what loses a precision: on a 2-core Xeon with AMX, chargpt's bf16 step ran 1.62x faster
        with math attention than with the CPU flash kernel torch picks, and 1.35x fp32's, where it had lost to fp32.
        Math is left out on CUDA, and where it would not fit (``attention_kernels``).
        """
        return [form(p, k) for p in self.candidates for k in attention_kernels(calls, self.device, p)]

    def picked_forms(self, calls: Sequence[AttentionCall]) -> tuple[list[str], str]:
        """Each reduced precision with the attention kernel it prefers, picked by timing the model's ``calls`` alone
        on each kernel that takes them (runtime/kernel_check.py: one ``KEEP`` faster than torch's pick, else torch's
        pick), and how each was picked, for the Plan. For a run that does not repay whole steps on every kernel: a
        precision then costs the trial no more steps than alone, and is timed on the kernel it runs fastest on, not on
        torch's pick (which lost chargpt's bf16 to fp32 on a CPU with AMX, 300 steps:
        benchmarks/results/frameworks-xeon-amx.md).
        """
        picked, told = [], []
        for precision in self.candidates:
            cast = [call.under(AUTOCAST_DTYPES[precision]) for call in calls]
            try:
                kernels, timed = time_against_pick(cast, self.device, precision, budget_s=KERNELS_TRIAL_S)
            except Exception as exc:  # torch's pick, as a run that cannot time them keeps it
                kernels, timed = [], {}
                told.append(f"{precision}'s attention kernels could not be timed ({describe_error(exc)}): torch's pick")
            kernel, ratio = preferred(timed)
            picked.append(form(precision, kernel or "auto"))
            alone = f"the model's attention calls ({len(calls)}), timed alone under {precision}"
            untimed = [str(k) for k in kernels if k is not None and k not in timed]
            if kernel is not None:
                told.append(f"{kernel} attention picked for {precision}: {alone}, ran {ratio:.2f}x torch's pick")
            elif len(kernels) > 1 and (None not in timed or untimed):  # never said to lose where it was not timed
                told.append(
                    f"torch's attention kernel kept for {precision}: {alone}, would take longer than "
                    f"{KERNELS_TRIAL_S:g} s on {', '.join(untimed) or 'any kernel'} (--attention KERNEL runs one)"
                )
            elif timed:
                told.append(f"torch's attention kernel kept for {precision}: no other ran {alone}, {KEEP}x faster")
        return picked, "; ".join(told)


def workload(task: Task, options: RuntimeOptions, batch_size: int, env: DistEnv) -> Workload | None:
    """The trial this run's auto precision would take; None where the precision is given or nothing is worth trying."""
    if options.precision != "auto":
        return None
    device, facts = worker_device(options, env)
    candidates = fast_precisions(facts)
    if not candidates:
        return None

    def shards() -> bool:  # FSDP asked, or "auto" picking it as the run's setup will, by the model's size
        return will_shard(
            options.strategy, world_size=env.world_size, device_mem_gib=facts.mem_gib, params=lambda: _params(task)
        )

    return Workload(
        device, facts, batch_size // env.world_size, candidates, options.channels_last, env.world_size,
        options.attention, shards=shards, deterministic=options.deterministic,
    )  # fmt: skip


def _params(task: Task) -> int:
    """The parameter count of the task's model, from its outline (the user's factory failing there is said as the
    fingerprint says it; a factory that draws weights leaves the run's random streams as they were)."""
    saved = capture_rng()
    try:
        with users_failure(f"task {task.name!r}: building the model (to count its parameters)", FINGERPRINT_HINT):
            return sum(p.numel() for p in task.outline().parameters())
    finally:
        restore_rng(saved)


def fingerprint_of(task: Task) -> str:
    """The task's fingerprint; the model factory or the dataset failing under it (the first of the user's code a
    run meets) is a TrainingError that shows their line, as the Trainer says it when it builds the model."""
    what = f"task {task.name!r}: building the model or reading the first item of train_data (the task's fingerprint)"
    with users_failure(what, FINGERPRINT_HINT):
        return task.fingerprint()


FINGERPRINT_HINT = (
    "the line above is in your model or dataset; a lazy module (nn.LazyLinear) needs one forward on a sample batch "
    "where it is built"
)


def worker_device(options: RuntimeOptions, env: DistEnv) -> tuple[torch.device, DeviceFacts]:
    """The device this process's Runtime will run on, and its facts."""
    local_rank = env.local_rank if env.distributed else None
    device = torch.device(resolve_worker_device(options.devices, probe_accelerators(), local_rank=local_rank).value)
    return device, probe_device(device)
