"""The forms a run's first steps check, as the Runtime sets them up and explains them (``FormsReport``: the Runtime's
``explain()`` and its compile counts).

``check_forms`` gives each model set up to the run's check (runtime/compile_check.py, ``CompileCheck``): the compile
the rule chose, the CUDA graphs auto proposed, the precision no trial decided. ``explain_forms`` gives the Plan's
axes as the check stands: decided, or being checked, with how far it got.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
from torch import nn

from redline.plan import Choice, Plan
from redline.plan.precision import PrecisionName
from redline.runtime.compile import CompileRecord, compile_counts, compile_seconds, explain_compile
from redline.runtime.compile_check import CompileCheck
from redline.runtime.cycle import Cycle
from redline.runtime.fused import unfused
from redline.runtime.graphs import GraphRecord
from redline.runtime.kernel_check import KernelCheck
from redline.runtime.layout import Layout
from redline.runtime.precision_check import PrecisionSwitch
from redline.runtime.stopwatch import StepTimer, Stopwatch


class FormsReport:
    """The Runtime's Plan as its run left it, and what its compiles cost: the forms the first steps checked, the
    layout a forward went back from, an optimizer fused SGD gave up."""

    _plan: Plan
    _compile_check: CompileCheck | None
    _compile_records: list[CompileRecord]
    _graphs: GraphRecord | None
    _kernels: KernelCheck | None
    _layout: Layout
    _models: list[nn.Module]
    _optimizer_rows: list[OptimizerRow]
    optimizer: torch.optim.Optimizer | None

    def _record_optimizer(self, model: nn.Module, row: OptimizerRow) -> None:
        """Keep ``row``, how set-up ``model``'s optimizer steps, for the Plan: one per model (a GAN's two), the latest
        optimizer of a model set up again."""
        index = next(i for i, known in enumerate(self._models) if known is model)
        self._optimizer_rows[index : index + 1] = [row]

    @property
    def compile_seconds(self) -> float | None:
        """Seconds spent compiling (the first compile and every recompile), once a compiled model has run."""
        return compile_seconds(self._compile_records)

    @property
    def compile_checking(self) -> bool:
        """Whether an automatic compile or CUDA graphs are still being checked on the run's first steps."""
        return self._compile_check is not None and not self._compile_check.decided

    @property
    def graphed_forwards(self) -> int:
        """Training forwards that replayed as CUDA graphs (runtime/graphs.py); 0 where none did."""
        return self._graphs.replays if self._graphs is not None else 0

    @property
    def training_compile_seconds(self) -> float:
        """Seconds spent compiling inside training steps (under autograd): a throughput leaves them out."""
        return compile_seconds(self._compile_records, training=True) or 0.0

    @property
    def compiles(self) -> tuple[int, int, list[str]]:
        """How many times the compiled models compiled, how many of those for training (under autograd; the
        rest for evaluation, under no_grad), and why each recompile happened."""
        return compile_counts(self._compile_records)

    def explain(self) -> Plan:
        """Return the resolved Plan: each axis with its value and the reason for it."""
        plan = explain_forms(self._plan, self._compile_check, self._compile_records, self._graphs, self._kernels)
        if self._layout.changed:  # since setup: the precision check's switch, or a forward that failed in NHWC
            plan = dataclasses.replace(plan, channels_last=self._layout.shown)
        if self._optimizer_rows and plan.optimizer is not None:  # the latest model's row may carry a resume's note
            rows = [
                row._replace(impl=plan.optimizer) if row.optimizer is self.optimizer else row
                for row in self._optimizer_rows
            ]
            plan = dataclasses.replace(plan, optimizer=optimizers_row(rows))
        return plan


class OptimizerRow(NamedTuple):
    """How one set-up model's optimizer steps: the model's class name, the optimizer, and its implementation."""

    model: str
    optimizer: torch.optim.Optimizer
    impl: Choice[str]


def optimizers_row(rows: list[OptimizerRow]) -> Choice[str]:
    """The Plan's optimizer row: how each set-up model's optimizer steps (as given since, where fused SGD met a
    parameter's late first gradient); one model's as its own, several (a GAN's) each named in one row."""
    choices = [Choice("as given", note) if (note := unfused(row.optimizer)) is not None else row.impl for row in rows]
    if len(choices) == 1:
        return choices[0]
    labels = [f"{row.model}'s {type(row.optimizer).__name__}" for row in rows]
    if len(set(labels)) < len(labels):  # two models of one class with one kind of optimizer: their order tells
        labels = [f"model {i}'s {type(row.optimizer).__name__}" for i, row in enumerate(rows, 1)]
    values = " / ".join(dict.fromkeys(choice.value for choice in choices))
    return Choice(
        values, "; ".join(f"{label}: {c.value}, {c.reason}" for label, c in zip(labels, choices, strict=True))
    )


def explain_forms(
    plan: Plan,
    check: CompileCheck | None,
    records: list[CompileRecord],
    graphs: GraphRecord | None,
    kernels: KernelCheck | None = None,
) -> Plan:
    """``plan``'s compile, precision, attention and CUDA graphs axes as the run left them: the first steps' ``check``
    as it stands, every compile of ``records`` counted, the graphs of ``graphs`` captured or turned off, and the
    attention kernel ``kernels`` timed on the run's own calls."""
    if plan.compile is not None:
        checked = check.explain() if check is not None else plan.compile
        plan = dataclasses.replace(plan, compile=explain_compile(checked, records))
    precision = check.explain_precision() if check is not None else None
    if precision is not None:
        plan = dataclasses.replace(plan, precision=cast(Choice[PrecisionName], precision))
    if kernels is not None and kernels.chosen is not None:  # timed on the run's own calls
        plan = dataclasses.replace(plan, attention=kernels.chosen)
    if plan.cuda_graphs is not None:
        found = check.explain_graphs() if check is not None else None
        requested = graphs.explain(plan.cuda_graphs) if graphs is not None else plan.cuda_graphs
        plan = dataclasses.replace(plan, cuda_graphs=found or requested)
    return plan


def check_forms(
    check: CompileCheck | None,
    planned: Choice[bool],
    graphs: Choice[bool],
    *,
    model: nn.Module,
    compiled: CompileRecord | None,
    graphed: GraphRecord | None,
    switch: PrecisionSwitch | None,
    another_model: bool,
    planned_steps: int,
    device: torch.device,
    memory_share: Callable[[], float | None],
    cycle: Cycle | None = None,
) -> CompileCheck | None:
    """The check of ``model`` set up: ``check`` (the run's so far, or None) with what this model adds to it: the
    compile the rule chose (``compiled``), the graphs auto proposed (``graphed``), the precision ``switch``; None
    where there is nothing to check. Its steps are timed on ``device``, each from a watched model's first training
    forward. ``another_model`` (a second model set up: a GAN's) ends the precision's check; its forwards begin steps
    too, so the check watches it as it does the first. ``cycle`` tells it of a loop that steps its optimizer itself,
    whose steps it cannot count."""
    if another_model and check is not None:
        check.another_model()
    if check is None and compiled is None and graphed is None and switch is None:
        return None
    if check is None:
        compiles = planned if compiled is not None else Choice(False, planned.reason)
        check = CompileCheck(compiles, planned_steps, StepTimer(Stopwatch(device=device)))
        if planned.value and compiled is None:  # a compile the run does not check (the caller's own): said as it is
            check.choice = planned
    if compiled is not None and not any(known is compiled for known in check.records):  # a model set up again
        check.add(compiled)  # is checked already
    if graphed is not None and check.graphs is None:
        check.add_graphs(graphed, graphs)
    if switch is not None:
        check.add_precision(switch, memory_share)
    if not check.decided:
        check.timer.watch(model)
    if cycle is not None:
        cycle.direct_step = check.stepped_directly
    return check
