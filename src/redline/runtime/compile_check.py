"""Confirming an automatic compile, CUDA graphs and precision on the run's own steps.

The compile rule (plan/compile.py) proposes compiling a long run on a GPU. Whether a compiled step is
faster depends on the model: on an H200, GPT-2-small at batch 64 ran 1.14x faster compiled, while the
digits CNN, a small model bound by kernel launches, ran 0.83x (benchmarks/results/h200-2026-12-04.md).
So where the rule, not the user, turned compile on, the run measures it: after a few settling steps it
times blocks of eager steps, then switches to the compiled forward and times as many compiled blocks. A step is
timed from its first training forward to its optimizer step (runtime/stopwatch.py, ``StepTimer``): what the loop
does between steps (an evaluation, a checkpoint, the loader's next batch) would weigh on whichever block it fell
in. The compiled forward stays only if its fastest block beats eager's by ``KEEP``; else the model runs its own
forward for the rest of the run, and the Plan says so with both figures. The compile's time is spent either way;
what the check saves is every later step. Where the eager steps show that the run is too short for any compile to
repay itself (the digits CNN's 2,000 steps of 2.2 ms on an H200, against a compile of 3-6 s), nothing is compiled.
The check needs no loss function and no copy of the model, so a user's own loop under the Runtime gets it as the
Trainer does. Under several processes rank 0's figures decide, and every rank follows at the same step.

CUDA graphs (runtime/graphs.py) are checked the same way, before the compile: on a CUDA device, where
"auto" proposes them, a phase of graphed steps follows the eager blocks, then the compiled phase if a
compile is planned and worth it. The fastest form stays if it beats eager by ``KEEP``; graphs cost a
capture of milliseconds, so no run is too short to try them.

Precision comes first, where no trial measured "auto" (runtime/precision_check.py): a phase in the other of
fp32 and bf16-mixed (in the layout the rule gives it) follows the eager blocks, and bf16-mixed stays only if it
beats fp32 by the trial's margin. The graphs and the compile are then timed in the precision kept, against eager
steps in it. Its phase ends after one timed block where that block already shows the other precision cannot win,
and it is left out where even one block could cost too much (``SLOWEST``, ``MOST_COST_S``) or, for fp32 on a GPU,
need memory the run may not have. The attention kernels bf16-mixed's phase times (runtime/kernel_check.py,
``KernelCheck``) get what that worst block leaves of the allowance, and stop timing where it runs out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from redline.parallel.collectives import run_on_rank0
from redline.plan import Choice, times
from redline.runtime.compile import CompileRecord, compile_seconds
from redline.runtime.graphs import GraphRecord
from redline.runtime.precision_check import PrecisionSwitch
from redline.runtime.stopwatch import StepTimer
from redline.runtime.trial import MARGIN

WARMUP = 3  # eager steps not timed: the first batches, the allocator and cuDNN's algorithm search settle
BLOCKS, BLOCK = 3, 5  # timed blocks of each kind, and optimizer steps per block
SETTLE = 2  # steps of a new form not timed: the first compiles (or captures) forward and backward, the second settles
KEEP = 1.03  # a candidate form must run this much faster than eager to stay: the noise of a few blocks
# Before compiling, the eager steps tell what a compile could save at most: a compiled step rarely runs more than
# twice as fast (the torch.compile tutorial: 1.3-2x on common models), and a compile takes seconds even for a
# small model (2.9-6.0 s for the digits CNN on an H200, 14.8 s for GPT-2-small). A run whose eager steps add up
# to less than LEAST_COMPILE_S / (1 - 1 / MOST_GAIN) is not compiled at all.
MOST_GAIN = 2.0
LEAST_COMPILE_S = 3.0
EAGER_END = WARMUP + BLOCKS * BLOCK  # the step after which the first candidate form takes over
PHASE = SETTLE + BLOCKS * BLOCK  # steps each candidate form runs
COMPILED_START = EAGER_END + SETTLE  # where the compile is the only candidate: its first timed step
STEPS = EAGER_END + PHASE  # the step after which a check of one candidate decides

# The other precision is timed only where a block of it costs little even if it runs SLOWEST times as slow as
# the rule's (fp32 ran GPT-2-small 2.9x slower than bf16-mixed on an H200): at most MOST_COST_S, or COST_SHARE of
# a run whose length is known. Its phase stops after the first timed block if that is SLACK times short of winning:
# one block is a noisy figure against eager's fastest of three, so only a block far from winning ends the phase.
SLOWEST = 3.0
MOST_COST_S = 1.0
COST_SHARE = 0.02
SLACK = 1.5
FP32_MEMORY = 0.45  # fp32 is not tried on a GPU whose memory the rule's bf16 steps filled beyond this share

PRECISION, GRAPHS, COMPILED = "precision", "graphs", "compiled"
EAGER = "eager"  # eager blocks timed anew, in a precision a failed comparison changed to
_NAMES = {GRAPHS: "graphed steps", COMPILED: "compiled steps"}


@dataclass
class CompileCheck:
    """Times the run's first steps eager, then graphed and compiled, and keeps the fastest (``after_step`` after each).

    ``planned`` is the compile axis as the rule planned it (False: the compile is no candidate); CUDA graphs
    join with ``add_graphs``. A block's time is its steps' own work, each step timed by the ``timer`` from its first
    training forward in a model it watches to its optimizer step (runtime/stopwatch.py). A test drives the check on
    a fake clock.
    """

    planned: Choice[bool]
    planned_steps: int
    timer: StepTimer = field(default_factory=StepTimer)
    records: list[CompileRecord] = field(default_factory=list)
    eager: list[float] = field(default_factory=list)  # seconds per step of each timed eager block
    compiled: list[float] = field(default_factory=list)
    graphed: list[float] = field(default_factory=list)
    steps: int = 0
    choice: Choice[bool] | None = None  # the compile axis, once decided
    graphs: GraphRecord | None = None
    graphs_planned: Choice[bool] | None = None
    graphs_choice: Choice[bool] | None = None  # the CUDA graphs axis, once decided
    phases: list[str] = field(default_factory=list)  # the candidate forms after eager, in order (known at EAGER_END)
    graphed_replays: int = 0  # forwards the graphs replayed in their phase (a call they cannot take runs eagerly)
    precision: PrecisionSwitch | None = None
    precisioned: list[float] = field(default_factory=list)  # seconds per step of each block in the other precision
    precision_choice: Choice[str] | None = None  # the precision axis, once decided
    memory_share: Callable[[], float | None] = lambda: None  # the device memory's peak share so far (None: unknown)
    decided: bool = False
    _replays_before: int = 0  # the graphs' replays when their phase began
    _index: int = 0  # the phase running, in ``phases``
    _started: int = 0  # the step after which it began

    def add(self, record: CompileRecord) -> None:
        """Check ``record``'s model too; it starts in the form the check is at (eager until the compiled phase)."""
        self.records.append(record)
        if self._form() != COMPILED:
            record.use_eager()

    def add_graphs(self, record: GraphRecord, planned: Choice[bool]) -> None:
        """Check CUDA graphs for ``record``'s model too (it runs its own forward until the graphed phase)."""
        self.graphs, self.graphs_planned = record, planned

    def add_precision(self, switch: PrecisionSwitch, memory_share: Callable[[], float | None]) -> None:
        """Check the rule's precision against ``switch.candidate`` first; ``memory_share`` reads the device memory's
        peak share (a GPU's), or None."""
        self.precision, self.memory_share = switch, memory_share

    def settled_precision(self) -> str | None:
        """The precision the run keeps if the check of it ends now: its decision, or the rule's (None: not checked)."""
        if self.precision is None:
            return None
        return (self.precision_choice or self.precision.planned).value

    def another_model(self) -> None:
        """A second model is being set up (a GAN's): the precision is checked no further, since its switch would fall
        between two optimizers' steps of one iteration. Called before that model is laid out for a precision."""
        self.drop_precision("a second model was set up, and a switch could fall between its step and the first's")

    def close(self) -> None:
        """The Runtime closed: the rule's precision stands where undecided, and the models keep no hook of the check."""
        self.drop_precision("the Runtime was closed before it decided")
        self.timer.unwatch()

    def stepped_directly(self) -> None:
        """The loop stepped a set-up optimizer itself (``optimizer.step()``), whose steps the check cannot count: it
        decides now, each form as the run has it (the rule's precision, the model's own forward: eager, no graphs)."""
        if self.decided:
            return
        reason = "the loop steps its optimizer itself (optimizer.step()), and the check counts rt.step(optimizer)'s"
        self.drop_precision(reason)
        if self.graphs is not None and self.graphs_choice is None and self.graphs.failed is None:
            self.graphs.stop(f"not checked on this run: {reason}")
        if self.choice is None and self.planned.value:
            for record in self.records:
                record.use_eager()
            self.choice = Choice(False, f"{self.planned.reason}, but not checked on this run: {reason}; not compiled")
        self.decided = True
        self.timer.unwatch()

    def drop_precision(self, reason: str) -> None:
        """Check the precision no further: the rule's stands from the next step (if undecided), for ``reason``."""
        switch = self.precision
        if switch is None:
            return
        if self.precision_choice is None:
            planned = switch.planned
            switch.use(planned.value)
            self.precision_choice = Choice(planned.value, f"{planned.reason}; not checked on this run: {reason}")
        switch.finish()

    def after_step(self) -> None:
        """Count an optimizer step; time, switch and decide at the steps the schedule names."""
        if self.decided:
            return
        self.timer.stepped()
        self.steps += 1
        self._schedule(self.steps)
        if self.decided:
            self.timer.unwatch()

    def _schedule(self, step: int) -> None:
        """Time a block, begin a phase, or decide, where ``step`` falls in the schedule."""
        if WARMUP <= step <= EAGER_END and (step - WARMUP) % BLOCK == 0:
            self._time_block(self.eager, first=step == WARMUP)
        if step == EAGER_END:
            self.phases = self._candidates()
            if not self.phases:
                self.decided = True  # nothing left to time: eager, for the reasons the candidates gave
                return
            self._begin(0)
        if step <= EAGER_END:
            return
        form = self.phases[self._index]
        at = step - self._started  # the phase's step, 1..PHASE
        if at >= SETTLE and (at - SETTLE) % BLOCK == 0:
            self._time_block(self._blocks(form), first=at == SETTLE)
        if at == PHASE or (form == PRECISION and self._precision_over(at)):
            self._end(form)
            if self._index + 1 < len(self.phases):
                self._begin(self._index + 1)
            else:
                self._decide()

    def _begin(self, index: int) -> None:
        self._index, self._started = index, self.steps
        self._switch(self.phases[index])

    def _end(self, form: str) -> None:
        if form == GRAPHS and self.graphs is not None:
            self.graphed_replays = self.graphs.replays - self._replays_before
        elif form == PRECISION:
            self._decide_precision()

    @property
    def end(self) -> int:
        """The step after which the check decides (as far as it can tell yet)."""
        if self.steps >= EAGER_END:
            return self._started + PHASE * (len(self.phases) - self._index) if self.phases else EAGER_END
        checking = self.precision is not None and self.precision_choice is None
        count = checking + (self.graphs is not None) + bool(self.planned.value)
        return EAGER_END + PHASE * count

    def explain(self) -> Choice[bool]:
        """The compile axis as the check stands: its decision, or the plan with how far the check got."""
        if self.choice is not None:
            return self.choice
        if not self.planned.value or self.decided:
            return self.planned
        end = self.end
        if self.steps < EAGER_END:
            return Choice(
                self.planned.value,
                f"{self.planned.reason}; checked on this run: {EAGER_END} steps eager, then {PHASE} each "
                f"{'graphed, then ' if self.graphs is not None else ''}compiled, and kept only if faster "
                f"(eager so far: {self.steps} of {end} steps)",
            )
        checking = f"being checked on this run (step {self.steps} of {end})"
        return Choice(self.planned.value, f"{self.planned.reason}; {checking}")

    def explain_graphs(self) -> Choice[bool] | None:
        """The CUDA graphs axis as the check stands (None when graphs are no candidate)."""
        if self.graphs is None or self.graphs_planned is None:
            return None
        planned = self.graphs_planned
        if self.graphs_choice is not None and (not self.graphs_choice.value or self.graphs.failed is None):
            return self.graphs_choice
        if self.graphs.failed is not None:  # stopped after the check kept them (a second model set up)
            return self.graphs.turned_off(planned.reason)
        return Choice(True, f"{planned.reason}; being checked on this run (step {self.steps} of {self.end})")

    def explain_precision(self) -> Choice[str] | None:
        """The precision axis as the check stands (None where precision is no candidate)."""
        switch = self.precision
        if switch is None:
            return None
        if self.precision_choice is not None:
            return self.precision_choice
        planned = switch.planned
        return Choice(
            planned.value,
            f"{planned.reason}; being checked on this run: {switch.candidate} timed against {planned.value} after "
            f"{EAGER_END} steps (step {self.steps} of {self.end})",
        )

    def _form(self) -> str:
        """The form the models run in now: "eager" or a phase's."""
        if self.decided:
            if self.choice is not None and self.choice.value:
                return COMPILED
            return GRAPHS if self.graphs_choice is not None and self.graphs_choice.value else "eager"
        if self.steps < EAGER_END or not self.phases:
            return "eager"
        return self.phases[self._index]

    def _blocks(self, form: str) -> list[float]:
        return {PRECISION: self.precisioned, GRAPHS: self.graphed, EAGER: self.eager}.get(form, self.compiled)

    def _switch(self, form: str) -> None:
        if form == EAGER:
            return  # the models run eagerly already: only the timing starts anew
        if form == PRECISION:
            assert self.precision is not None
            self.precision.use(self.precision.candidate)
        elif form == GRAPHS:
            for record in self.records:
                record.use_eager()
            assert self.graphs is not None
            self.graphs.use_graphed()
            self._replays_before = self.graphs.replays
        else:
            if self.graphs is not None:
                self.graphs.use_eager()
            for record in self.records:
                record.use_compiled()

    def _candidates(self) -> list[str]:
        phases = []
        if self.precision is not None and self.precision_choice is None:
            unchecked = self._precision_unchecked()
            if unchecked:
                planned = self.precision.planned
                self.precision_choice = Choice(planned.value, f"{planned.reason}; not checked on this run: {unchecked}")
            else:
                phases.append(PRECISION)
        if self.graphs is not None and self.graphs.failed is None:
            phases.append(GRAPHS)
        if self.records and self.planned.value and self._worth_compiling():
            phases.append(COMPILED)
        return phases

    def _precision_unchecked(self) -> str:
        """Why the other precision is not timed on this run ("" where it is)."""
        assert self.precision is not None
        if self.precision.outside:  # the rule's steps ran under the loop's own autocast: they time nothing
            return self.precision.outside
        eager, candidate = min(self.eager), self.precision.candidate
        cost = (SETTLE + BLOCK) * eager * (SLOWEST - 1)
        allowed = max(MOST_COST_S, COST_SHARE * self.planned_steps * eager)
        if cost > allowed:
            return (
                f"its steps take {eager * 1e3:.3g} ms, so a block of {candidate} steps could cost up to {cost:.1f} s "
                f"more (if {SLOWEST:g}x as slow), beyond the check's {allowed:.1f} s"
            )
        share = self.memory_share() if candidate == "fp32" else None
        if share is not None and share > FP32_MEMORY:
            return f"its steps filled {share:.0%} of the device's memory, and fp32 could need up to twice bf16's"
        if self.precision.kernels is not None:  # the attention kernels are timed within what the block leaves
            self.precision.kernels.budget_s = allowed - cost
        return ""

    def _precision_over(self, at: int) -> bool:
        """Whether the precision phase ends early: the other precision was dropped, or its first block cannot win."""
        assert self.precision is not None
        if self.precision.failed is not None or self.precision_choice is not None:
            return True
        if at != SETTLE + BLOCK or not self.precisioned:
            return False
        return self._precision_ratio() < self._precision_needs() / SLACK

    def _precision_ratio(self) -> float:
        """How many times faster the other precision ran than the rule's (its fastest block against eager's)."""
        return min(self.eager) / min(self.precisioned)

    def _precision_needs(self) -> float:
        """The ratio at which the other precision is kept: bf16-mixed must beat fp32 by the trial's margin."""
        assert self.precision is not None
        return MARGIN if self.precision.candidate != "fp32" else 1 / MARGIN

    def _decide_precision(self) -> None:
        """Keep the faster of the two precisions (bf16-mixed by a margin), or the one a failed comparison leaves."""
        switch = self.precision
        assert switch is not None
        planned, candidate = switch.planned, switch.candidate
        after = f"from step {self.steps + 1}"
        if self.precision_choice is not None:  # dropped (a second model, a closed Runtime): the rule's stands
            return
        if switch.failed is not None or not self.precisioned:
            kept = switch.fallback or planned.value
            why = switch.failed or "no block of it was timed"
            self.precision_choice = Choice(kept, f"{planned.reason}; checked on this run: {why}: {kept} {after}")
            if kept != planned.value and self._index + 1 < len(self.phases):  # no step of it was timed: the forms
                self.eager = []  # still to come are held against eager blocks timed anew in it
                self.phases.insert(self._index + 1, EAGER)
        else:
            ratio, blocks = self._precision_ratio(), len(self.precisioned)
            kept = candidate if ratio >= self._precision_needs() else planned.value
            figures = (
                f"{candidate} steps ran {times(ratio)} {planned.value} ({min(self.precisioned) * 1e3:.3g} against "
                f"{min(self.eager) * 1e3:.3g} ms, fastest of {blocks} block{'s' if blocks > 1 else ''} of {BLOCK} "
                f"steps each; {switch.compared or 'outputs not compared: no training forward of the model ran'})"
            )
            if kept == candidate != "fp32" and not switch.by_value:  # faster, but perhaps wrong: never on timing alone
                kept = planned.value
                figures += f", but its outputs were not held against {planned.value}'s, so it is not adopted"
            if kept == candidate:
                self.eager = self.precisioned  # the forms timed next are held against eager steps in this precision
                self.precision_choice = Choice(
                    kept,
                    f"measured on this run: {figures}: {kept} {after}; the rule alone would have kept {planned.value} "
                    f"({planned.reason})",
                )
            else:
                reason = f"{planned.reason}; checked on this run: {figures}: {kept} {after}"
                self.precision_choice = Choice(kept, reason)
        switch.use(self.precision_choice.value)
        switch.finish()  # decided: a forward still to come is not compared

    def _time_block(self, blocks: list[float], *, first: bool) -> None:
        """End a block (``first``: start one) and keep its seconds per step."""
        seconds = self.timer.block()
        if not first:
            blocks.append(seconds / BLOCK)

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
        self.decided = True
        eager = min(self.eager)
        timed = {form: min(self._blocks(form)) for form in self.phases if form not in (PRECISION, EAGER)}
        if GRAPHS in timed and (self._graphs_missed() or (self.graphs is not None and self.graphs.failed is not None)):
            timed.pop(GRAPHS)  # its blocks ran the model's own forward, in all or in part

        def best() -> str:
            fastest = min(timed, key=lambda form: timed[form], default="eager")
            return fastest if fastest != "eager" and eager / timed[fastest] >= KEEP else "eager"

        kept = str(run_on_rank0(best, "the compile check"))  # rank 0's figures
        figures = {
            form: f"{_NAMES[form]} ran {times(eager / seconds)} eager ({seconds * 1e3:.3g} against "
            f"{eager * 1e3:.3g} ms, fastest of {BLOCKS} blocks of {BLOCK} steps each)"
            for form, seconds in timed.items()
        }
        after = f"from step {self.steps + 1}"
        if kept != COMPILED and COMPILED in self.phases:
            for record in self.records:
                record.use_eager()
            spent = compile_seconds(self.records) or 0.0
            beaten = f", and {figures[kept]}" if kept != "eager" else ""
            self.choice = Choice(
                False,
                f"{self.planned.reason}, but on this run {figures[COMPILED]}{beaten}: "
                f"{'CUDA graphs' if kept == GRAPHS else 'eager'} {after} (the compile took {spent:.1f} s)",
            )
        elif kept == COMPILED:
            self.choice = Choice(True, f"{self.planned.reason}; confirmed on this run: {figures[COMPILED]}")
        if self.graphs is not None and self.graphs_planned is not None:
            self.graphs_choice = self._graphs_decided(kept, figures, after)

    def _graphs_missed(self) -> str:
        """Why the graphed phase's timing is not the graphs' ("" when every timed step replayed them)."""
        if GRAPHS not in self.phases or self.graphed_replays >= BLOCKS * BLOCK:
            return ""
        return (
            f"the graphs replayed {self.graphed_replays} of the {PHASE} forwards of their phase (its {BLOCKS * BLOCK} "
            "timed steps need as many), and the others ran the model's own (keyword or non-tensor arguments, inputs "
            "of other shapes, eval mode, or a second forward in a step), so their timing is not the graphs'"
        )

    def _graphs_decided(self, kept: str, figures: dict[str, str], after: str) -> Choice[bool]:
        assert self.graphs is not None and self.graphs_planned is not None
        planned, record = self.graphs_planned.reason, self.graphs
        if record.failed is not None:
            return record.turned_off(planned)
        missed = self._graphs_missed()
        if missed:
            record.drop()
            return Choice(False, f"{planned}, but off: {missed}")
        if kept == GRAPHS:
            record.use_graphed()
            captured = f"captured in {record.seconds:.2f} s; {record.compared}"
            return Choice(True, f"{planned}; confirmed on this run: {figures[GRAPHS]} ({captured})")
        record.drop()
        instead = "the compiled forward" if kept == COMPILED else "the model's own forward"
        return Choice(False, f"{planned}, but on this run {figures[GRAPHS]}: {instead} {after}")
