"""Confirming an automatic compile on the run's own steps.

The compile rule (plan/compile.py) proposes compiling a long run on a GPU. Whether a compiled step is
faster depends on the model: on an H200, GPT-2-small at batch 64 ran 1.14x faster compiled, while the
digits CNN, a small model bound by kernel launches, ran 0.83x (benchmarks/results/h200-2026-12-04.md).
So where the rule, not the user, turned compile on, the run measures it: after a few settling steps it
times blocks of eager steps, then switches to the compiled forward and times as many compiled blocks,
each block between two synchronisations. The compiled forward stays only if its fastest block beats
eager's by ``KEEP``; else the model runs its own forward for the rest of the run, and the Plan says so
with both figures. The compile's time is spent either way (a trial on a copy would spend it too); what
the check saves is every later step. And where the eager steps show that the whole run is too short
for any compile to repay itself (the digits CNN's 2,000 steps of 2.2 ms on an H200, against a compile
of 3-6 s), the model is not compiled at all. The check needs no loss function and no copy of the model, so a
user's own loop under the Runtime gets it as the Trainer does. Under several processes rank 0's
figures decide, and every rank follows at the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redline.parallel.collectives import run_on_rank0
from redline.plan import Choice, times
from redline.runtime.compile import CompileRecord

WARMUP = 3  # eager steps not timed: the first batches, the allocator and cuDNN's algorithm search settle
BLOCKS, BLOCK = 3, 5  # timed blocks of each kind, and optimizer steps per block
SETTLE = 2  # compiled steps not timed: the first compiles forward and backward, the second settles
KEEP = 1.03  # the compiled steps must run this much faster than eager to stay: the noise of a few blocks
# Before compiling, the eager steps tell what a compile could save at most: a compiled step rarely runs more than
# twice as fast (the torch.compile tutorial: 1.3-2x on common models), and a compile takes seconds even for a
# small model (2.9-6.0 s for the digits CNN on an H200, 14.8 s for GPT-2-small). A run whose eager steps add up
# to less than LEAST_COMPILE_S / (1 - 1 / MOST_GAIN) is not compiled at all.
MOST_GAIN = 2.0
LEAST_COMPILE_S = 3.0
EAGER_END = WARMUP + BLOCKS * BLOCK  # the step after which the compiled forward takes over
COMPILED_START = EAGER_END + SETTLE
STEPS = COMPILED_START + BLOCKS * BLOCK  # the step after which the check decides


@dataclass
class CompileCheck:
    """Times the run's first steps eager, then compiled, and keeps the faster (``after_step`` after each step).

    ``sync`` waits for the device (so a block's time is its work's), ``clock`` reads seconds; both are
    given so a test can drive the check with a fake clock.
    """

    planned: Choice[bool]
    planned_steps: int
    sync: Callable[[], None]
    clock: Callable[[], float] = time.perf_counter
    records: list[CompileRecord] = field(default_factory=list)
    eager: list[float] = field(default_factory=list)  # seconds per step of each timed eager block
    compiled: list[float] = field(default_factory=list)
    steps: int = 0
    choice: Choice[bool] | None = None  # once decided
    _mark: float = 0.0

    def add(self, record: CompileRecord) -> None:
        """Check ``record``'s model too; it starts in the form the check is at (eager until the switch)."""
        self.records.append(record)
        if self.steps < EAGER_END or (self.choice is not None and not self.choice.value):
            record.use_eager()

    def after_step(self) -> None:
        """Count an optimizer step; time, switch and decide at the steps the schedule names."""
        if self.choice is not None:
            return
        self.steps += 1
        step = self.steps
        if WARMUP <= step <= EAGER_END and (step - WARMUP) % BLOCK == 0:
            self._time_block(self.eager, first=step == WARMUP)
        if step == EAGER_END:
            if not self._worth_compiling():
                return
            for record in self.records:
                record.use_compiled()
        if COMPILED_START <= step <= STEPS and (step - COMPILED_START) % BLOCK == 0:
            self._time_block(self.compiled, first=step == COMPILED_START)
        if step == STEPS:
            self._decide()

    def explain(self) -> Choice[bool]:
        """The compile axis as the check stands: its decision, or the plan with how far the check got."""
        if self.choice is not None:
            return self.choice
        if self.steps < EAGER_END:
            return Choice(
                self.planned.value,
                f"{self.planned.reason}; checked on this run: {EAGER_END} steps eager, then {STEPS - EAGER_END} "
                f"compiled, and kept only if faster (eager so far: {self.steps} of {STEPS} steps)",
            )
        return Choice(
            self.planned.value, f"{self.planned.reason}; being checked on this run (step {self.steps} of {STEPS})"
        )

    def _time_block(self, blocks: list[float], *, first: bool) -> None:
        self.sync()
        now = self.clock()
        if not first:
            blocks.append((now - self._mark) / BLOCK)
        self._mark = now

    def _worth_compiling(self) -> bool:
        """Whether the run's eager steps leave a compile anything to repay itself with; if not, decide on eager now
        (nothing was compiled: the compiled forward compiles on its first call)."""
        eager = min(self.eager)
        saved = self.planned_steps * eager * (1 - 1 / MOST_GAIN)
        worth = bool(run_on_rank0(lambda: saved >= LEAST_COMPILE_S, "the compile check"))  # rank 0's figures
        if not worth:
            self.choice = Choice(
                False,
                f"{self.planned.reason}, but on this run eager steps take {eager * 1e3:.3g} ms: {self.planned_steps} "
                f"of them ({self.planned_steps * eager:.1f} s) cannot repay a compile (at least {LEAST_COMPILE_S:g} s, "
                f"saving at most {1 - 1 / MOST_GAIN:.0%} of each step); not compiled",
            )
        return worth

    def _decide(self) -> None:
        eager, compiled = min(self.eager), min(self.compiled)
        keep = bool(run_on_rank0(lambda: eager / compiled >= KEEP, "the compile check"))  # rank 0's figures
        figures = (
            f"compiled steps ran {times(eager / compiled)} eager ({compiled * 1e3:.3g} against {eager * 1e3:.3g} ms, "
            f"fastest of {BLOCKS} blocks of {BLOCK} steps each)"
        )
        if keep:
            self.choice = Choice(True, f"{self.planned.reason}; confirmed on this run: {figures}")
            return
        for record in self.records:
            record.use_eager()
        spent = sum(record.seconds or 0.0 for record in self.records)
        self.choice = Choice(
            False,
            f"{self.planned.reason}, but on this run {figures}: eager from step {STEPS + 1} "
            f"(the compile took {spent:.1f} s)",
        )
