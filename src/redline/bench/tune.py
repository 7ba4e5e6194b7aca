"""`redline tune`: search the settings auto cannot rank by rule, for the least total time of the planned run.

The search goes one axis at a time, in the order their gains usually rank: precision, compile
(and on CUDA its CUDA-graphs mode), channels_last, loader workers, then micro-batching (the same
batch per optimizer step, as several micro-batches with gradient accumulation). Each axis times
the current best against its alternatives side by side (the bench's rotating windows) and keeps
the one whose planned run, compile included, is shortest; a change must win by ``MARGIN``, so
noise never swaps a setting for an equal one. Alternatives that cannot win, or that a run would not
take, are not tried (bench/tune_space.py). A compiled candidate whose
compile fell back to eager is rejected, its reason said: it ran the eager model. When the
budget is spent, no candidate starts. A warm-up already begun (a compile) is not cut short, so a
search can end past its budget; the "budget" reason says by how much, and why. An axis the search
did not measure in full (the budget spent, or a Ctrl-C) is cached as unmeasured: "kept" is no
decision where the alternative never ran, so a run that uses the tune decides that axis as auto.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from redline.bench.compile_cache import cache_lookups, charged_first, reset_compiler, served_from_cache
from redline.bench.figures import rate
from redline.bench.loops import Runner, quiet_failed_ops, ran_eagerly, runtime_runner
from redline.bench.matrix import Setting
from redline.bench.run import check_sizes, task_steps, time_runners, timed_steps
from redline.bench.tune_cache import TuneInterrupted, cache_tune
from redline.bench.tune_space import refused_split, search_space, skipped_axes
from redline.config import positive_int, positive_number, seed_number
from redline.errors import (
    ONE_STEP,
    RedlineError,
    StoppedBySignal,
    TrainingError,
    describe_error,
    few,
    interrupting_signal,
    invalid,
    noting_interrupts,
)
from redline.hardware.contention import Sampler
from redline.hardware.device import probe_accelerators, probe_device
from redline.plan import Choice
from redline.plan.attention import DEFAULT
from redline.plan.device import resolve_device
from redline.runtime.attention import AttentionCall, attention_kernels, model_attention
from redline.runtime.options import RuntimeOptions
from redline.runtime.seed import keeps_rng
from redline.runtime.trial import Measured, judge
from redline.runtime.tuned import (
    BUSY_NOTE,
    MICRO_BATCHES,
    NOT_SEARCHED,
    Candidate,
    Trial,
    TunedPlan,
    check_tuned_cache,
)
from redline.runtime.workload import fingerprint_of
from redline.task import Task, require_task

MARGIN = 1.05  # an alternative replaces the current setting where the current's planned run is 1.05x as long
UNMEASURED = "not measured: the budget was spent"
LEFT = "left to the run's auto"  # what a run that uses the tune does with an axis the tune did not decide
# A compile takes at least this long before its first step (a two-layer MLP's, torch's caches warm: 1.7 s on a 2-core
# Xeon): a planned run shorter than this eagerly cannot be made shorter by one, and is not compiled to find out
LEAST_COMPILE_S = 1.0
WINDOW = 5  # timed steps between two device syncs
STREAM_STEPS = 1000  # the run weighed for a stream without a length (no epochs to count), unless planned_steps says
# A candidate that leaves the kernel to auto runs torch's pick per call, untimed: the other kernels are candidates
_PICK_OWN = {"attention": Choice(DEFAULT, "torch's pick per call: the tune times each other kernel as a candidate")}
Progress = Callable[[int, int, str], None]


@keeps_rng  # it seeds torch for its own steps: the caller's RNG streams go on as they were
def tune(
    task: Task,
    *,
    devices: str = "auto",
    batch_size: int | None = None,
    budget_s: float = 120.0,
    planned_steps: int | None = None,
    steps: int = 30,
    window: int = WINDOW,
    seed: int = 0,
    progress: Progress | None = None,
) -> tuple[TunedPlan, str]:
    """Search precision, compile, layout, loader workers and micro-batching on ``task``; cache and return the winner.

    Returns the tuned Plan and the path of its cache entry, which ``redline train --plan tuned``
    (and auto) read. ``planned_steps`` is the run the total time is weighed for (default: the
    task's epochs, or ``STREAM_STEPS`` for a stream without a length); ``budget_s`` bounds the whole
    search: no candidate starts once it is spent, and ``reasons["budget"]`` says how long the search
    took (by how much past the budget, and why: a compile begun is not cut short). ``batch_size`` tunes at
    another batch size than the task's, for a run given the same (``TrainerConfig(batch_size=...)``,
    ``--batch-size``).

    An axis not measured in full (the budget spent before it, or before its alternatives) is cached
    in ``unmeasured``: a run that uses the tune decides it as auto. A Ctrl-C (KeyboardInterrupt) caches
    what was measured so, then raises ``TuneInterrupted`` (exit 130 on the command line), whose
    ``tuned`` and ``path`` are the Plan and its cache entry; before the first axis was measured it
    raises ``StoppedBySignal``, and nothing is cached.
    """
    task = require_task(task)
    positive_number("budget_s", budget_s)
    positive_int("steps", steps)
    positive_int("window", window)
    positive_int("planned_steps", planned_steps, optional=True)
    positive_int("batch_size", batch_size, optional=True)
    seed_number("seed", seed)
    check_tuned_cache()
    fingerprint = fingerprint_of(task)  # of the Task as given: a run looks it up so, its batch size beside it
    if batch_size is not None:
        task = dataclasses.replace(task, batch_size=batch_size)
    check_sizes(task, [task.batch_size])  # before the search: the hint names the largest that fits
    device = _one_device(devices)
    facts = probe_device(torch.device(device))
    own = task_steps(task, task.batch_size)
    planned = planned_steps or own or STREAM_STEPS
    # the run the "use it" line prints: --max-steps where --planned-steps (or a stream) set it, else the task's epochs
    run_steps = planned if planned_steps is not None or own is None else None
    calls = model_attention(task, device)
    skipped = skipped_axes(task, facts, calls=calls)
    axes = search_space(task, facts, calls=calls, skipped=skipped)
    # a bare Runtime's key to the tune, built before the search: a factory's seconds after the search lay outside its
    # Ctrl-C handling, and a signal there lost all of it
    keyed = task.outline()
    tell = progress or (lambda done, total, what: None)
    started = time.perf_counter()
    deadline = started + budget_s
    best = Candidate(precision="fp32")
    trials: list[Trial] = []
    reasons: dict[str, str] = {}
    interrupted = ""  # the axis a Ctrl-C (or SIGTERM) stopped: it and the axes after it are left to the run's auto
    signum = int(signal.SIGINT)
    unmeasured: list[str] = []  # the axes whose alternatives were not all measured: "kept" there decides nothing
    sampler = Sampler().start()  # other processes' load on the CPUs while the candidates run
    with noting_interrupts() as noted:  # a Ctrl-C that Python drops inside the compile's callbacks is noted
        for index, (axis, values) in enumerate(axes):
            tell(index, len(axes), f"tuning {axis}")
            left = deadline - time.perf_counter()
            if interrupted:
                unmeasured.append(axis)
                reasons[axis] = f"not measured: the search was interrupted ({signal.Signals(signum).name}); {LEFT}"
                continue
            if left <= 0:
                unmeasured.append(axis)
                reasons[axis] = f"not measured: the {budget_s:g} s budget was spent; {LEFT}"
                continue
            if refused := _not_tried(task, best, axis, values, trials, planned, run_steps):  # cannot win or refused
                reasons[axis] = refused
                continue
            candidates = _candidates(best, axis, values, calls, device)
            if len(candidates) == 1:  # nothing else runs here: no other attention kernel takes the model's calls
                reasons[axis] = (
                    f"{_value(best, axis)} kept: no other kernel takes the model's calls in {best.precision}"
                )
                continue
            try:
                measured = _measure(task, device, candidates, planned, steps, window, seed, left)
                noted.raise_lost()  # one raised in a weakref callback or __del__, which Python dropped
            except KeyboardInterrupt as exc:  # keep what the axes before it measured, to show and cache (also on
                noted.caught()  # SIGTERM, where the command line takes it as a Ctrl-C)
                interrupted, signum = axis, interrupting_signal(exc)
                unmeasured.append(axis)
                reasons[axis] = f"not measured: the search was interrupted ({signal.Signals(signum).name}); {LEFT}"
                continue
            trials += (measured := charged_first(measured, trials))  # the best's graph as first compiled, cold
            before = best
            best, reasons[axis] = decide(axis, measured, planned)
            if any(trial.rejected == UNMEASURED for trial in measured) and getattr(best, axis) == getattr(before, axis):
                unmeasured.append(axis)  # kept, with an alternative never run: no decision
                reasons[axis] = f"not measured in full: {reasons[axis]}; {LEFT}"
            if axis == "compile_mode" and best.compile and not before.compile:  # CUDA graphs won where compile lost
                mode = reasons.pop(axis)
                reasons["compile"] = f"compile on in mode {mode}; the default mode alone lost: {reasons['compile']}"

    def finish() -> tuple[TunedPlan, str]:  # the search's result, cached; it runs again where a signal lands in it
        _kernel_with_precision(best, unmeasured, reasons)
        _check_measured(task, trials, interrupted, budget_s, signum, decided=len(unmeasured) < len(axes))
        reasons.update({axis: f"{NOT_SEARCHED}: {why}" for axis, why in skipped.items()})
        spent, stopped_by = time.perf_counter() - started, signal.Signals(signum).name if interrupted else ""
        reasons["budget"] = _budget_line(spent, budget_s, trials, len(axes), unmeasured, stopped_by)
        busy = _busy(sampler)
        reasons["budget"] += f"; {BUSY_NOTE.format(busy)}" * bool(busy)
        tuned = TunedPlan(
            task=task.name, device=device, batch_size=task.batch_size, planned_steps=planned,
            measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), best=best,
            reasons=_plan_reasons(reasons), trials=tuple(trials), unmeasured=tuple(unmeasured), busy=busy,
        )  # fmt: skip
        return tuned, cache_tune(tuned, fingerprint, facts, keyed, interrupted, signum)

    try:
        tell(len(axes), len(axes), "done")
        return finish()
    except KeyboardInterrupt as exc:  # a signal as the ended search is cached: cache all of it, then stop as asked
        tuned, path = finish()  # (a search a signal stopped before raises its own TuneInterrupted from here)
        raise TuneInterrupted(tuned, path, "", tuned.unmeasured, interrupting_signal(exc)) from None


def _busy(sampler: Sampler) -> str:
    """How busy other processes kept the CPUs while the search ran, where that left its threads too few ("" where
    not, or not known)."""
    contention = sampler.stop(torch.get_num_threads())
    return str(contention) if contention is not None and contention.contended else ""


def _kernel_with_precision(best: Candidate, unmeasured: list[str], reasons: dict[str, str]) -> None:
    """Keep an attention kernel the precision axis chose with its precision where the attention axis went unmeasured
    (the budget spent, a Ctrl-C): left to auto, the run would pair the precision with the kernel it lost with."""
    if "attention" in unmeasured and best.attention != "auto":
        unmeasured.remove("attention")
        reasons["attention"] = (
            f"{best.attention} attention, timed with {best.precision} on the precision axis (its own axis was not "
            "measured)"
        )


def _check_measured(
    task: Task, trials: Sequence[Trial], interrupted: str, budget_s: float, signum: int, *, decided: bool
) -> None:
    """Refuse a search that ran no candidate (nothing to choose from, or to show), or that the budget let decide no
    axis (``decided``): a Plan that leaves every axis to auto is auto, and caching it as tuned would say otherwise."""
    if interrupted and not trials:
        raise StoppedBySignal(
            signum,
            f"tune interrupted by {signal.Signals(signum).name} while it measured {interrupted}, its first axis: "
            "no Plan was cached\n"
            "hint: run it again; --budget SECONDS bounds the search instead, showing what it measured",
        )
    if not trials or not (decided or interrupted):  # the budget ran out before an axis was measured in full
        raise invalid("budget_s", budget_s, "enough seconds to measure one axis", "e.g. budget_s=120")
    if all(trial.rejected for trial in trials):  # a Plan of nothing measured must not be cached for --plan tuned
        first = trials[0]
        raise TrainingError(
            f"no candidate of {task.name} ran ({len(trials)} tried); {_value(first.candidate, '')}: {first.rejected}\n"
            f"hint: fix the task, then tune again; `{ONE_STEP}` runs one step and shows the line that fails"
        )


def _budget_line(
    spent_s: float, budget_s: float, trials: Sequence[Trial], axes: int, unmeasured: list[str], stopped_by: str
) -> str:
    """The budget row: how long the search took (``spent_line``), or that a signal (``stopped_by``) stopped it; where
    the budget left axes to auto, a budget likely to measure every axis: the seconds per axis measured, in tens."""
    if stopped_by:
        return f"interrupted ({stopped_by}) after {_figure(spent_s)} s of the {budget_s:g} s budget"
    enough = max(10, math.ceil(spent_s / max(1, axes - len(unmeasured)) * axes * 1.5 / 10) * 10)
    left = f"; {few(unmeasured, 4)} left to auto: about {enough} s would measure every axis" if unmeasured else ""
    return spent_line(spent_s, budget_s, trials) + left


def _one_device(devices: str) -> str:
    """The device to tune for; a bench's list is refused: a tuned Plan is for the one device a run trains on."""
    if "," in devices:
        first = devices.split(",")[0].strip() or "cpu"
        allowed = "one device: 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
        raise invalid("devices", devices, allowed, f"tune one at a time, e.g. devices={first!r}")
    return resolve_device(devices, probe_accelerators()).value


def _candidates(
    best: Candidate, axis: str, values: list[Any], calls: Sequence[AttentionCall], device: str
) -> list[Candidate]:
    """The candidates of ``axis`` now (``_alternatives``), the current best first.

    For the attention kernel, the values are torch's pick ("auto") and the kernels that take the model's calls in the
    precision chosen before. A reduced precision is also tried with each such kernel, as the precision trial tries
    it: torch's pick can be what loses it (chargpt's bf16 step on a CPU with AMX ran 1.62x faster with math attention
    than with the flash kernel torch picks, and faster than fp32, where it had lost), and the attention axis alone,
    after fp32 was kept, would never see that. Math is left out on CUDA, where a fused kernel takes any call it does.
    """
    if axis == "attention":  # every kernel that takes the calls is searched here, math on CUDA too
        found = attention_kernels(calls, device, best.precision, math_on_cuda=True)
        values = ["auto", *(kernel for kernel in found if kernel in values)]
    candidates = _alternatives(best, axis, values)
    if axis != "precision" or not calls:
        return candidates
    with_kernels = [
        dataclasses.replace(candidate, attention=kernel)
        for candidate in candidates
        if candidate.precision != "fp32"
        for kernel in attention_kernels(calls, device, candidate.precision)
        if kernel != candidate.attention
    ]
    return candidates + with_kernels


def _not_tried(
    task: Task,
    best: Candidate,
    axis: str,
    values: Sequence[Any],
    trials: Sequence[Trial],
    planned: int,
    run_steps: int | None,
) -> str:
    """Why ``axis`` is not measured: a compile that cannot win (the planned run takes less eagerly than any compile
    takes), micro-batches the run of ``run_steps`` (None: the task's epochs) would refuse (``refused_split``); "" where
    it is measured."""
    if axis == "grad_accum":
        return refused_split(task, best, max(values), max_steps=run_steps)
    if axis not in ("compile", "compile_mode") or best.compile:
        return ""
    eager = [t.total_s(planned) for t in trials if t.candidate == best]  # the best so far, measured on an earlier axis
    if not eager or math.isinf(eager[-1]) or eager[-1] >= LEAST_COMPILE_S:
        return ""
    return (
        f"{_value(best, axis)} kept, not tried: the planned {planned} steps take {eager[-1]:.2f} s eagerly, less "
        f"than any compile takes ({LEAST_COMPILE_S:g} s at least, torch's caches warm)"
    )


def decide(axis: str, measured: Sequence[Trial], planned: int) -> tuple[Candidate, str]:
    """Keep the current setting (the first trial) unless an alternative's planned run is ``MARGIN`` shorter."""
    current, *others = measured
    if math.isinf(current.total_s(planned)):
        viable = [t for t in others if not math.isinf(t.total_s(planned))]
        current = min(viable, key=lambda t: t.total_s(planned), default=current)
    fastest = min((t for t in others if t is not current), key=lambda t: t.total_s(planned), default=None)
    told = "; ".join(_told(t, planned) for t in measured)
    if fastest is not None and fastest.total_s(planned) * MARGIN < current.total_s(planned):
        gain = current.total_s(planned) / fastest.total_s(planned)
        chosen = _value(fastest.candidate, axis)
        return fastest.candidate, f"{chosen}, {gain:.2f}x less time for {planned} steps ({told})"
    return current.candidate, f"{_value(current.candidate, axis)} kept ({told})"


def _alternatives(best: Candidate, axis: str, values: Sequence[Any]) -> list[Candidate]:
    """The current best first, then each of ``values`` on ``axis`` in its place.

    A compile mode is tried with compile on even where the default compile lost: CUDA graphs
    (reduce-overhead) cut the kernel launches that bind a small model, which a default compile leaves
    (on an H200 the digits CNN ran 0.83x eager compiled by default, its GPU busy 4% of each step).
    CUDA graphs of the uncompiled model (runtime/graphs.py) are tried against the best so far, compiled
    or not, as they capture in milliseconds where a compile takes seconds.
    """
    if axis == "compile_mode" and not best.compile:
        return [best, *(dataclasses.replace(best, compile=True, compile_mode=v) for v in values if v != "default")]
    if axis == "cuda_graphs":  # graphs replay the model's own forward: against a compiled best, uncompiled
        return [best, *(dataclasses.replace(best, compile=False, compile_mode="default", cuda_graphs=True),)]
    if axis == "grad_accum" and best.cuda_graphs:  # a graphed step back-propagates once: micro-batches run eagerly
        return [best, *(dataclasses.replace(best, grad_accum=v, cuda_graphs=False) for v in values if v != 1)]
    return [best, *(dataclasses.replace(best, **{axis: v}) for v in values if v != getattr(best, axis))]


def _measure(
    task: Task,
    device: str,
    candidates: list[Candidate],
    planned: int,
    steps: int,
    window: int,
    seed: int,
    budget_s: float,
) -> list[Trial]:
    """Warm each candidate up alone, then time them side by side; each trial's step is one optimizer step.

    torch.compile's cache is process-wide, so it is cleared first: a candidate pays its compile as a
    fresh run would, not a graph an earlier axis compiled. Within the axis, a candidate whose graph
    an earlier one compiled (loader workers leave the model as it is) is charged that compile.
    Once ``budget_s`` is spent, the candidates not yet warmed up are not measured (the first always is, and timed
    where an alternative started); a warm-up begun, compile included, is not cut short, nor are the timed rounds.
    """
    deadline = time.perf_counter() + budget_s
    reset_compiler([device] if any(c.compile for c in candidates) else [])
    runners: list[Runner] = []
    failed: dict[int, str] = {}
    facts = probe_device(torch.device(device))  # what each candidate's layout is resolved for
    for index, candidate in enumerate(candidates):
        if index and time.perf_counter() >= deadline:  # the current setting is measured: the axis has begun
            failed[index] = UNMEASURED
            continue
        setting = Setting("explicit", device, candidate.precision, candidate.compile, task.batch_size)
        options = candidate.options(RuntimeOptions(devices=device), facts)
        try:
            runner = runtime_runner(
                task, setting, seed=seed, planned_steps=planned, options=options, measured=_PICK_OWN
            )  # a candidate with torch's pick runs it (the other kernels are candidates of their own)
            lookups = cache_lookups()
            with quiet_failed_ops():  # the warm-up compiles
                runner.run(window)
            runner.compile_cached = served_from_cache(lookups, cache_lookups())
        except RedlineError:
            raise
        except Exception as exc:  # a setting this machine cannot run
            failed[index] = f"it failed: {describe_error(exc)}"
            continue
        eager = ran_eagerly(runner, compiled=candidate.compile, graphs=candidate.cuda_graphs)
        if eager:
            failed[index] = eager
        else:
            runners.append(runner)
    left = max(0.0, deadline - time.perf_counter())  # the warm-ups (compiles) spent the rest
    alone = 0 not in failed and len(runners) == 1 and UNMEASURED in failed.values()  # no alternative to time against
    timed = {} if alone else time_runners(runners, window, timed_steps(steps, window) // window, left)
    reference = next((r.first_loss for r in runners if r.setting.precision == "fp32"), None)
    trials, position = [], 0
    compiles: dict[Candidate, tuple[float, bool]] = {}  # a graph's compile (seconds, from the on-disk caches)
    for index, candidate in enumerate(candidates):
        if index in failed:
            trials.append(Trial(candidate, None, rejected=failed[index]))
            continue
        runner = runners[position]
        windows, error = timed.get(position, ([], UNMEASURED))  # a current setting left alone is not timed
        position += 1
        per_s = rate(windows, window)  # optimizer steps per second (a runner's step is all its micro-batches)
        step_s = 1 / per_s if per_s and not error else None
        graph = dataclasses.replace(candidate, loader_workers=None)
        paid = (runner.compile_seconds() or 0.0, bool(runner.compile_cached))
        compile_s, cached = compiles.setdefault(graph, paid) if candidate.compile else (0.0, False)
        trials.append(Trial(candidate, step_s, compile_s, error or _departure(runner, reference), cached))
    return trials


def _departure(runner: Runner, reference: float | None) -> str:
    """Why a candidate's first loss rules it out against fp32's ("" when it does not): the trial's rule."""
    first = runner.first_loss
    if first is None:
        return "no loss was measured"
    if reference is None or runner.setting.precision == "fp32":
        return "" if math.isfinite(first) else "a loss turned non-finite"
    return judge(Measured("fp32", (), (reference,)), Measured(runner.setting.precision, (), (first,)))


def _told(trial: Trial, planned: int) -> str:
    label = _value(trial.candidate, "")
    if trial.rejected == UNMEASURED:
        return f"{label}: {UNMEASURED}"
    if trial.rejected:
        return f"{label}: rejected, {trial.rejected}"
    assert trial.step_s is not None
    # a compile torch's on-disk caches served costs a machine that never compiled the model more
    notes = ["as first compiled in this tune"] * trial.first_compile + ["cached on disk"] * trial.compile_cached
    cached = f" ({', '.join(notes)})" if notes else ""
    compile_ = f" + {trial.compile_s:.1f} s compile{cached}" if trial.candidate.compile else ""
    return f"{label}: {_figure(trial.step_s * 1e3)} ms/step{compile_} = {_figure(trial.total_s(planned))} s"


def spent_line(spent_s: float, budget_s: float, trials: Sequence[Trial]) -> str:
    """How long the search took against its budget; past it, by how much and why."""
    if spent_s <= budget_s:
        return f"searched in {_figure(spent_s)} s of the {budget_s:g} s budget"
    why = "a warm-up once begun is not cut short, and each candidate measured runs two timed rounds at least"
    compiled = [t for t in trials if t.candidate.compile and t.compile_s]
    if compiled:
        longest = max(compiled, key=lambda t: t.compile_s)
        why += f"; the longest compile took {longest.compile_s:.1f} s ({longest.candidate.label})"
    return f"searched in {_figure(spent_s)} s, {_figure(spent_s - budget_s)} s over the {budget_s:g} s budget: {why}"


def _figure(value: float) -> str:
    """Three significant digits, never e-notation: "2,660" (not "2.66e+03"), "0.0398" for a short run (not "0.0")."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _value(candidate: Candidate, axis: str) -> str:
    if not axis:
        return candidate.label
    value = getattr(candidate, axis)
    if axis == "loader_workers":
        return "the device's rule for workers" if value is None else f"{value} loader worker{'s' * (value != 1)}"
    if axis == "grad_accum":
        return "one batch per step" if value == 1 else f"{value} {MICRO_BATCHES}"
    if isinstance(value, bool):
        return f"{axis} {'on' if value else 'off'}"
    if axis == "compile_mode" and not candidate.compile:
        return "compile off"
    if axis == "attention":
        return "torch's pick of attention kernel" if value == "auto" else f"{value} attention"
    if axis == "precision" and candidate.attention != "auto":
        return f"{value} with {candidate.attention} attention"
    return str(value)


def _plan_reasons(reasons: dict[str, str]) -> dict[str, str]:
    """The reasons keyed by the Plan's axes (compile_mode is shown on the compile axis)."""
    out = dict(reasons)
    mode = out.pop("compile_mode", None)
    if mode is not None and "compile" in out:
        out["compile"] += f"; mode {mode}"
    return out
