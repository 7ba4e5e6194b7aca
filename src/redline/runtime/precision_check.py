"""Checking an automatic precision on the run's own steps, where no trial measured it.

A trial (runtime/trial.py) measures "auto" precision on a copy of the model before a run, but only where
it has the Task (a loss to train the copy with) and a run long enough to repay about 26 extra steps. A
Runtime in the user's own loop has neither, so there the rule's pick went unmeasured: fp32 on a CPU with
AMX, where bf16-mixed ran the digits CNN 1.6x faster, and bf16-mixed on an H200, where it ran the same
CNN 0.84x fp32 (benchmarks/results/). The run's own first steps measure it instead, as they do the
compile (runtime/compile_check.py): after the eager blocks in the rule's precision, a phase of steps runs in
the other of fp32 and bf16-mixed, and bf16-mixed is kept only if it beats fp32 by the trial's margin.
The steps are the run's own, so the check costs only the difference between the two, and less where the
first timed block already shows the other cannot win (the phase stops there).

The numbers are checked too. Before the phase's first training forward (any forward with autograd on: a loop
that trains in eval mode, its BatchNorm statistics and dropout frozen, trains all the same; but one in eval mode
outside rt.autocast() is a validation that forgot no_grad, and the next is waited for), the model runs on
copies of its inputs in both precisions, without autograd, with the random streams and BatchNorm statistics put
back after each (so dropout draws alike), and the two outputs are compared. bf16-mixed whose outputs depart from
fp32's by more than ``TOLERANCE`` of their norm, or are not finite where fp32's are, is never used: the step's
own forward then runs in fp32, and so does the run. A candidate whose forward fails (an op without a bf16
kernel) is dropped the same way, and the step runs in the rule's precision. Nor is bf16-mixed adopted on its
timing alone where no output of it was compared by value (``by_value``).

The step's own forward runs once, last, on the inputs as given: what it leaves behind (an attribute it sets,
a feature a hook keeps, BatchNorm's statistics) is its own. What a forward does besides computing (a call
counter, a hook's side effect) happens three times at that one step.

The layout "auto" chose switches with the precision (runtime/layout.py): on a CPU with AMX, bf16-mixed's steps run
channels_last, as the rule lays out bf16 convolutions there, and fp32's NCHW. So does the attention kernel, where it
is left to auto (runtime/kernel_check.py, ``KernelCheck``): the comparison's forwards record the model's attention
calls, which are timed alone on each kernel that takes them, and one faster than torch's pick runs bf16-mixed's
phase and stays with it (chargpt's bf16 step on a CPU with AMX lost to fp32 with torch's flash kernel, and beat it
with math).

Only fp32 and bf16-mixed are switched: fp16 needs a loss scale from the first step. The switch happens
between optimizer steps, through ``rt.autocast()``: a loop that enters it for each step follows it, and
a loop whose forward runs outside it (or under an autocast of its own) is not checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from redline.errors import describe_error
from redline.hardware.device import DeviceFacts
from redline.plan import Choice
from redline.plan.precision import live_candidate
from redline.runtime.attention import AttentionCall, autocast_dtype, recording
from redline.runtime.compile import compiled_by_user
from redline.runtime.kernel_check import KernelCheck
from redline.runtime.options import RuntimeOptions
from redline.runtime.precision import AUTOCAST_DTYPES
from redline.runtime.probe import probe_forward
from redline.runtime.weak_hook import WeakHook

# The largest departure of bf16-mixed's outputs from fp32's, relative to the norm of fp32's: bf16 keeps 8 bits of
# mantissa, so a forward in it departs by a few tenths of a percent (0.4-0.6% for the built-in examples, a
# dropout MLP and attention); a model whose numbers bf16 cannot hold departs by far more.
TOLERANCE = 0.05
_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16}
UNCOMPARED = "not compared by value"  # how compare_outputs begins where it found nothing to hold bf16 against
KERNELS_ALONE_S = 1.0  # the most the kernels' timing takes in a run with no precision phase to share an allowance


@dataclass
class PrecisionSwitch:
    """The rule's precision (``planned``) and the other one the run's first steps time against it.

    ``apply(name)`` has the Runtime run in that precision from the next step on; ``watch`` names the module
    whose first forward in the other precision is compared with the rule's.
    """

    planned: Choice[str]
    candidate: str
    apply: Callable[[str], None]
    device_type: str
    module: nn.Module | None = None
    current: str = ""
    compared: str = ""  # how the two precisions' outputs compared on the phase's first batch
    by_value: bool = False  # they were compared value by value (not for want of a finite floating-point output)
    failed: str | None = None  # why the other precision was dropped before its timing could decide
    fallback: str = ""  # the precision the run takes when it was: fp32 where bf16 departed, else the rule's
    done: bool = False  # decided or given up: nothing is compared any more
    _handles: list[Any] = field(default_factory=list)
    _probing: bool = False  # the no_grad forwards of the comparison are running
    _context: contextlib.AbstractContextManager[Any] | None = None  # the precision the step's forward runs in instead
    kernels: KernelCheck | None = None  # the attention kernel bf16-mixed's phase runs, where it is left to auto
    outside: str = ""  # why the rule's phase cannot be timed: its first training forward ran under another autocast
    _watching: RemovableHandle | None = None  # the hook that looks at that forward

    def __post_init__(self) -> None:
        self.current = self.planned.value

    def watch(self, module: nn.Module) -> None:
        self.module = module
        if self._watching is None:  # the rule's phase: its steps must run in the rule's precision to be timed so
            self._watching = module.register_forward_pre_hook(WeakHook(self, "_first_forward"))

    def _first_forward(self, module: nn.Module, args: Any) -> None:
        if self._probing or not torch.is_grad_enabled() or self._watching is None:
            return  # the comparison's own forwards, or evaluation (a training forward may run in eval mode)
        running = autocast_dtype(self.device_type)
        outside = running != _AUTOCAST_DTYPES.get(self.current)
        if outside and not module.training:
            return  # a validation without no_grad, outside rt.autocast(): the training forward is still to come
        self._watching.remove()
        self._watching = None
        if self.current == self.planned.value and outside:
            self.outside = _outside(running)  # a loop's own autocast: the rule's steps ran in another precision

    def use(self, name: str) -> None:
        """Run in ``name`` from the next step; the first training forward in the candidate is compared."""
        if name == self.candidate and not self.compared and self.failed is None and not self.done:
            self._arm()  # before ``apply``: a pre-hook it adds (the layout's check, runtime/layout.py) runs first
        else:
            self.disarm()
        if self.kernels is not None:  # a kernel timed in one precision runs only in it
            self.kernels.follow(name)
        if name != self.current:
            self.apply(name)
            self.current = name

    def finish(self) -> None:
        """Compare nothing more (the check decided, gave up, or the Runtime closed); a kernel timed in the precision
        not kept goes with it."""
        self.done = True
        self.disarm()
        kernels = self.kernels
        if kernels is not None and kernels.timed_in is not None and kernels.timed_in != self.current:
            kernels.drop(f"{self.current} stays")

    def disarm(self) -> None:
        if self._watching is not None and self.done:
            self._watching.remove()
            self._watching = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        context, self._context = self._context, None
        if context is not None:  # a forward that raised between the two hooks: autocast's nesting is put back
            context.__exit__(None, None, None)

    def _arm(self) -> None:
        if self.module is not None and not self._handles:
            self._handles = [  # first among the pre-hooks: it sees the arguments before a user's hook changes them
                self.module.register_forward_pre_hook(
                    WeakHook(self, "_before_forward"), with_kwargs=True, prepend=True
                ),  # held weakly: a copy of the model made meanwhile (a best model kept) copies no Runtime
                self.module.register_forward_hook(WeakHook(self, "_after_forward"), always_call=True),
            ]

    def _before_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Run both precisions on copies of the inputs, without autograd, the random streams and buffers put back
        after each; compare them. The step's own forward then runs once, last, in the candidate, or in the
        precision left where the candidate failed."""
        if self._probing or not torch.is_grad_enabled():
            return  # the comparison's own forwards, or evaluation in between (a training forward may run in eval mode)
        running = autocast_dtype(self.device_type)
        if running != _AUTOCAST_DTYPES.get(self.candidate) and not module.training:
            return  # a validation without no_grad, outside rt.autocast(): the training forward is still to come
        if running != _AUTOCAST_DTYPES.get(self.candidate):
            self._fail(self.planned.value, _outside(running))
            self.disarm()
            return
        outputs: dict[str, Any] = {}
        calls: dict[str, list[AttentionCall]] = {}
        for name in (self.candidate, self.planned.value):
            try:
                record: contextlib.AbstractContextManager[list[AttentionCall]] = (
                    recording() if self._times_kernels() else contextlib.nullcontext([])
                )  # the attention calls, for the kernel check alone
                with record as calls[name]:
                    outputs[name] = self._probe(module, args, kwargs, name)
            except Exception as exc:  # the step goes on in the rule's precision, which ran this model before
                self._fail(self.planned.value, f"its forward in {name} failed: {describe_error(exc)}")
                break
        if self.failed is None:
            departure, said = compare_outputs(outputs["fp32"], outputs["bf16-mixed"])
            if departure <= TOLERANCE:
                self.compared, self.by_value = said, not said.startswith(UNCOMPARED)
                if self.kernels is not None and self._times_kernels():  # before the step's own forward, which
                    self.kernels.check(calls[self.candidate], self.candidate)  # then runs on the kernel kept
                return
            self._fail("fp32", f"bf16-mixed was dropped: {said}")
        if self.fallback != self.candidate:
            self._context = autocast_for(self.fallback, self.device_type)
            self._context.__enter__()  # left in the forward hook, right after this forward

    def _times_kernels(self) -> bool:
        """Whether the phase times the kernels: a bf16-mixed one (a run that starts in bf16 timed them at its first
        training forward, ``propose_checks``)."""
        return self.kernels is not None and self.candidate != "fp32"

    def _probe(self, module: nn.Module, args: Any, kwargs: Any, precision: str) -> Any:
        self._probing = True
        try:
            with autocast_for(precision, self.device_type):
                return probe_forward(module, args, kwargs)
        finally:
            self._probing = False

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._probing:
            return
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)
        if self.compared or self.failed is not None:
            self.disarm()

    def _fail(self, fallback: str, reason: str) -> None:
        self.failed, self.fallback = reason, fallback


def _outside(running: torch.dtype | None) -> str:
    """Why a forward that ran under ``running`` (autocast's dtype, None: off) is not one rt.autocast() gave."""
    return (
        f"the loop's forward ran {'under autocast to ' + str(running) if running else 'without autocast'}, not in "
        "the precision rt.autocast() gives (enter it for each step's forward to have it followed)"
    )


def propose_switch(
    options: RuntimeOptions,
    facts: DeviceFacts,
    planned: Choice[str],
    apply: Callable[[str], None],
    *,
    model: nn.Module,
    decided: bool,
    strategy: str,
    world_size: int,
    attention: Choice[str] | None = None,
) -> PrecisionSwitch | None:
    """The switch to the other precision for the run's first steps to time (``model``'s first forward in it compared
    with the rule's), where "auto" was left to the rule; None where a trial or a tuned Plan ``decided`` it, or the
    run could not switch it safely: several processes or a sharded strategy (each rank's forward would be compared
    alone), a compile or graphs asked for (fixed to one autocast), ``deterministic`` (a run that must repeat
    itself cannot follow a timing), or a model that trains parameters of another dtype than float32 (they stay in
    it whatever the precision, and float16 ones would train unscaled under bf16-mixed). With ``attention`` (the
    axis left to auto), a bf16-mixed phase also times the attention kernels on the model's own calls
    (runtime/kernel_check.py, ``KernelCheck``)."""
    other = live_candidate(options.precision, planned.value, facts)
    held = decided or strategy != "single" or world_size > 1 or options.deterministic
    held = held or any(p.dtype != torch.float32 for p in model.parameters() if p.requires_grad)
    if held or other is None or "on" in (options.compile, options.cuda_graphs):
        return None
    switch = PrecisionSwitch(planned, other, apply, facts.type)
    if other == "bf16-mixed" and attention is not None:
        switch.kernels = KernelCheck(_device(model, facts), attention)
    switch.watch(model)
    return switch


def propose_checks(
    options: RuntimeOptions,
    facts: DeviceFacts,
    planned: Choice[str],
    apply: Callable[[str], None],
    *,
    model: nn.Module,
    measured: Collection[str] | None,
    tuned: bool,
    strategy: str,
    world_size: int,
    attention: Choice[str] | None,
) -> tuple[PrecisionSwitch | None, KernelCheck | None]:
    """What the run's first steps check of its precision and attention kernel (``attention``: the axis, where it was
    left to auto): the precision ``switch`` where no trial ``measured`` it and no ``tuned`` Plan set it
    (``propose_switch``, which times the kernels in its bf16-mixed phase where the trial did not time them).

    A run that starts in a reduced precision (asked for, or the rule's: a GPU's bf16, with or without an fp32 phase)
    times the kernels after its first training forward in ``rt.autocast()`` instead (runtime/kernel_check.py,
    ``KernelCheck.around``); in a run that times fp32 too, the kernel chosen sits out the fp32 phase, and goes if
    fp32 stays. That is where nothing decided the run's axes before it: a Runtime given no ``measured`` at all (a
    user's loop; the Trainer, the bench and the tune decide theirs by a trial or a search), not tuned, in one
    process (each would time its own), not ``deterministic`` (a run that must repeat itself), no compile or CUDA
    graphs asked for (they fix the kernel at their first step), and a model the user did not compile
    (``compiled``)."""
    known = measured or ()
    switch = propose_switch(
        options, facts, planned, apply, model=model, decided="precision" in known or tuned, strategy=strategy,
        world_size=world_size, attention=None if "attention" in known else attention,
    )  # fmt: skip
    held = measured is not None or tuned or world_size > 1 or strategy != "single" or options.deterministic
    held = held or planned.value not in AUTOCAST_DTYPES or "on" in (options.compile, options.cuda_graphs)
    if attention is None or held or compiled_by_user(model):  # a recorder in its forward would compile it again
        return switch, switch.kernels if switch is not None else None
    device = _device(model, facts)
    kernels = KernelCheck(device, attention, budget_s=KERNELS_ALONE_S, pending=planned.value, module=model)
    if switch is not None:  # a run in bf16 first: its switch times fp32, a phase the kernel sits out
        switch.kernels = kernels
    return switch, kernels


def _device(model: nn.Module, facts: DeviceFacts) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device(facts.type))


def autocast_for(precision: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast as ``precision`` runs it: off for fp32 (whatever an outer context asked), bf16 for bf16-mixed."""
    dtype = _AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)


def compare_outputs(fp32: Any, other: Any) -> tuple[float, str]:
    """How far ``other``'s floating-point outputs are from ``fp32``'s, and what that means: the largest norm of their
    difference relative to fp32's norm, over the values fp32 gives finite; 0 where nothing can be compared (no finite
    fp32 value, no floating-point output); inf where other's have other shapes, or are not finite where fp32's are
    (or are where fp32's are not: a mask's -inf, say, must come out as it does in fp32)."""
    first, second = _leaves(fp32), _leaves(other)
    if [t.shape for t in first] != [t.shape for t in second]:
        return math.inf, "its outputs have other shapes than fp32's"
    if not first:
        return 0.0, f"{UNCOMPARED}: no floating-point tensor found in the model's outputs"
    finite = [torch.isfinite(t) for t in first]
    if not any(bool(kept.any()) for kept in finite):
        return 0.0, f"{UNCOMPARED}: fp32's own outputs are not finite"
    if not all(bool(torch.isfinite(b[kept]).all()) for b, kept in zip(second, finite, strict=True)):
        return math.inf, "its outputs are not finite where fp32's are"
    if not all(_same(a[~kept], b[~kept]) for a, b, kept in zip(first, second, finite, strict=True)):
        return math.inf, "its outputs are not the infinities or NaNs fp32's give where fp32's are not finite"
    worst = max(
        float((a[kept] - b[kept]).norm()) / max(float(a[kept].norm()), 1e-12)
        for a, b, kept in zip(first, second, finite, strict=True)
    )
    if worst > TOLERANCE:
        return worst, f"its outputs depart from fp32's by {worst:.1%} of their norm (more than {TOLERANCE:.0%})"
    return worst, f"outputs within {worst:.1%} of fp32's"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values, NaN where the other has NaN."""
    return bool(torch.where(torch.isnan(a), torch.isnan(b), a == b).all())


def _leaves(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors in ``output``: in tuples, lists, dicts (a ModelOutput) and dataclasses."""
    if isinstance(output, torch.Tensor):
        return [output.detach().float()] if output.is_floating_point() else []
    if isinstance(output, Mapping):
        items: Any = output.values()
    elif isinstance(output, (list, tuple)):
        items = output
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [getattr(output, f.name) for f in dataclasses.fields(output)]
    else:
        return []
    return [t for item in items for t in _leaves(item)]
