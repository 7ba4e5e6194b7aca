"""A bench row's figures, from the windows its steps were timed in: rates, step times, memory, FLOP/s and MFU,
compile time and its break-even, and the speed-ups over the naive loop of its device and of the CPU."""

from __future__ import annotations

import dataclasses
import math

import torch

from redline.bench.figures import break_even, paired_interval, percentile, rate, speedup, step_times
from redline.bench.isolate import RowEnded, RowFailed, RowProcess
from redline.bench.loops import Runner, ran_eagerly
from redline.bench.matrix import Setting
from redline.bench.memory import Peak
from redline.bench.result import BenchRow, Peaks, RowFacts, uses_tf32
from redline.errors import RedlineError, describe_error
from redline.hardware.catalog import find_gpu, peak_tflops
from redline.hardware.device import probe_device
from redline.hardware.flops import matmul_precision, mfu, share_of_peak
from redline.runtime.cache import best_matmul_peak
from redline.runtime.contract import ONE_SAMPLE_HINT, count_tokens, one_sample_refusal

Built = dict[Setting, tuple[Runner | RowProcess, Peak, int | None]]  # each row's runner, warm-up peak and FLOPs


def row_facts(runner: Runner, *, compiled: bool, peaks: Peaks, want_peak: bool) -> RowFacts:
    """``runner``'s facts, measuring its matmuls' peak where ``want_peak`` and ``peaks`` has none for its key (and
    adding it there)."""
    plan = runner.plan()
    precision = plan.precision.value if plan is not None else "fp32"
    matmuls = matmul_precision(precision, runner.model)  # a bfloat16 model trained in fp32 runs at the bf16 peak
    # the naive loop's fp32 matmul runs without TF32, a Runtime row's with
    key = (runner.setting.device, matmuls, uses_tf32(plan))
    if want_peak and matmuls is not None and key not in peaks:
        device = torch.device(runner.setting.device)
        with runner.scope():
            peaks[key] = best_matmul_peak(device, probe_device(device), matmuls)
    assert runner.first_batch is not None
    counted = count_tokens(runner.first_batch[1])
    return RowFacts(
        plan=plan,
        compile_s=runner.compile_seconds(),
        compile_cached=runner.compile_cached,
        trial_s=runner.trial_s,
        trial_cached=runner.trial_cached,
        first_step_s=runner.first_step_s,
        steps_run=runner.steps_run,
        micro_steps=runner.micro_steps,
        tokens=int(counted) if counted is not None else None,
        matmuls=matmuls,
        matmul_peak=peaks.get(key),
        eager=ran_eagerly(runner, compiled=compiled),
    )


def bench_rows(
    group: list[Setting],
    built: Built,
    timed: dict[int, tuple[list[float], str]],
    failed: dict[Setting, str],
    window: int,
) -> list[BenchRow]:
    """The rows of one batch size's ``group``: each with its figures, or the error that failed it.

    Every row's loss is of the same optimizer step, one past the most any row has run: an auto row's warm-up runs
    on until the run's check of its compile or CUDA graphs decides (35 steps), and the rows it left behind catch
    up, untimed, so that the rows' losses compare.
    """
    rows = []
    position = {setting: i for i, setting in enumerate(built)}
    peaks: Peaks = {}
    naive: dict[str, list[float]] = {}
    ran = {s: _facts_or_error(built[s][0], s, timed[position[s]][1], peaks, built[s][2]) for s in built}
    last = max((facts.steps_run for facts in ran.values() if isinstance(facts, RowFacts)), default=0)
    for setting in group:
        base = base_row(setting)
        facts = ran[setting] if setting in ran else failed[setting]
        if isinstance(facts, RowFacts):
            try:  # a step that fails after the timing fails its row, as one within it does: the others keep theirs
                loss = _loss_at(built[setting][0], last + 1 - facts.steps_run)
            except RedlineError:
                raise
            except Exception as exc:
                facts = row_error(exc)
        if isinstance(facts, str):
            rows.append(dataclasses.replace(base, error=facts))
            continue
        _, memory, flops = built[setting]
        windows = timed[position[setting]][0]
        row = _figures(base, facts, windows, window, memory, flops, loss)
        rows.append(dataclasses.replace(row, loss_step=last + 1))
        if setting.kind == "naive":  # it ran whole: the others' rounds pair with its windows
            naive[setting.device] = windows
    return _with_break_even(_with_shared_compiles(_with_intervals(rows, group, timed, position, naive)))


def _facts_or_error(
    runner: Runner | RowProcess, setting: Setting, error: str, peaks: Peaks, flops: int | None
) -> RowFacts | str:
    """A timed row's facts, or why it failed: in its timing, reading them, or running eagerly where it was to
    compile ("compiled" must mean compiled)."""
    if error:
        return error
    try:
        facts = _facts(runner, compiled=setting.compile is True, peaks=peaks, want_peak=flops is not None)
    except RedlineError:
        raise
    except Exception as exc:
        return row_error(exc)
    return facts.eager or facts


def _with_intervals(
    rows: list[BenchRow],
    group: list[Setting],
    timed: dict[int, tuple[list[float], str]],
    position: dict[Setting, int],
    naive: dict[str, list[float]],
) -> list[BenchRow]:
    """Give each row that ran the interval of its round-by-round speed-up over the naive loop of its device, where
    that loop ran whole (a failed one's windows are no measurement)."""
    out = []
    for setting, row in zip(group, rows, strict=True):
        if setting.kind != "naive" and not row.error and setting.device in naive:
            interval = paired_interval(naive[setting.device], timed[position[setting]][0])
            row = dataclasses.replace(row, speedup_naive_interval=interval)
        out.append(row)
    return out


def row_error(exc: BaseException) -> str:
    """A failed row's error, with the fix where redline knows the cause (a batch norm given one sample); a row's
    own process said its error whole."""
    if isinstance(exc, RowFailed | RowEnded):
        return str(exc)
    return describe_error(exc) + (f" ({ONE_SAMPLE_HINT})" if one_sample_refusal(exc) else "")


def _facts(runner: Runner | RowProcess, *, compiled: bool, peaks: Peaks, want_peak: bool) -> RowFacts:
    if isinstance(runner, RowProcess):  # measured in the row's own process; its peak is kept for the rows after it
        facts = runner.facts(compiled=compiled, peaks=peaks, want_peak=want_peak)
        peaks.setdefault((runner.setting.device, facts.matmuls, facts.tf32), facts.matmul_peak)
        return facts
    return row_facts(runner, compiled=compiled, peaks=peaks, want_peak=want_peak)


def base_row(setting: Setting) -> BenchRow:
    """A row of ``setting`` without figures yet."""
    return BenchRow(
        setting.name, setting.kind, setting.device, setting.precision, setting.compile, None, setting.batch_size
    )


def _with_shared_compiles(rows: list[BenchRow]) -> list[BenchRow]:
    """Give a compiled row whose graph an earlier row compiled that row's compile seconds (and whether torch's
    on-disk caches served them): what a run of it alone would pay. torch.compile's caches are process-wide, so its
    own compile took little time (the kernels were built) or none (the graph was held)."""
    paid: dict[tuple[str, str, bool | None], BenchRow] = {}
    out = []
    for row in rows:
        key = (row.device, row.precision, row.channels_last)
        if row.compile and key in paid:
            row = dataclasses.replace(row, compile_s=paid[key].compile_s, compile_cached=paid[key].compile_cached)
        elif row.compile and row.compile_s is not None:
            paid[key] = row
        out.append(row)
    return out


def _figures(
    base: BenchRow,
    facts: RowFacts,
    windows: list[float],
    window: int,
    memory: Peak,
    flops: int | None,
    loss: float | None,
) -> BenchRow:
    plan = facts.plan
    precision = plan.precision.value if plan is not None else "fp32"
    compiled = bool(plan.compile.value) if plan is not None and plan.compile is not None else False
    layout = bool(plan.channels_last.value) if plan is not None and plan.channels_last is not None else False
    samples = rate(windows, base.batch_size * window)
    tokens = rate(windows, facts.tokens * facts.micro_steps * window) if facts.tokens is not None else None
    per_step = step_times(windows, window)
    achieved = flops * samples / base.batch_size if flops and samples else None
    facts_of_device = probe_device(torch.device(base.device))
    spec = find_gpu(facts_of_device.name) if facts_of_device.type == "cuda" else None
    matmuls = facts.matmuls
    peak = peak_tflops(spec, matmuls, tf32=facts.tf32) if spec and matmuls else None
    p50, p90 = percentile(per_step, 50), percentile(per_step, 90)
    return dataclasses.replace(
        base,
        precision=precision,
        compile=compiled,
        channels_last=layout,
        samples_per_s=samples,
        tokens_per_s=tokens,
        step_ms_p50=p50 * 1e3 if p50 is not None else None,
        step_ms_p90=p90 * 1e3 if p90 is not None else None,
        peak_mem_bytes=memory.peak,
        peak_mem_kind=memory.kind if memory.peak is not None else "",
        tflops=achieved / 1e12 if achieved is not None else None,
        mfu=mfu(achieved, peak) if achieved is not None else None,
        mfu_measured=share_of_peak(achieved, facts.matmul_peak) if achieved is not None else None,
        compile_s=facts.compile_s,  # an auto row's check may compile, then keep eager: the run pays it all the same
        compile_cached=facts.compile_cached if facts.compile_s is not None else None,
        trial_s=facts.trial_s,
        trial_cached=facts.trial_cached,
        first_step_s=facts.first_step_s,
        loss=loss,
        plan=plan.to_dict() if plan is not None else None,
    )


def _loss_at(runner: Runner | RowProcess, steps: int) -> float | None:
    """The loss of the last of ``steps`` more steps (outside the timing), as a check that the row trains."""
    value = runner.run(steps)
    return value if math.isfinite(value) else None


def _with_break_even(rows: list[BenchRow]) -> list[BenchRow]:
    """Give each compiled row the steps its compile takes to repay, against the eager row of its precision: its
    compile and auto's trial, where one ran, as both are paid before the run's first step and the eager row pays
    neither."""
    eager = {(r.device, r.precision): r for r in rows if r.kind == "explicit" and r.compile is False and not r.error}
    out = []
    for row in rows:
        twin = eager.get((row.device, row.precision))
        if row.compile and twin is not None and row.step_ms_p50 and twin.step_ms_p50:
            paid = row.compile_s + (row.trial_s or 0.0) if row.compile_s is not None else None
            steps = break_even(paid, twin.step_ms_p50 / 1e3, row.step_ms_p50 / 1e3)
            row = dataclasses.replace(row, break_even_steps=steps)
        out.append(row)
    return out


def with_speedups(rows: list[BenchRow]) -> list[BenchRow]:
    naive = {(r.device, r.batch_size): r.samples_per_s for r in rows if r.kind == "naive" and not r.error}
    return [
        dataclasses.replace(
            row,
            speedup_naive=speedup(row.samples_per_s, naive.get((row.device, row.batch_size))),
            speedup_cpu_fp32=speedup(row.samples_per_s, naive.get(("cpu", row.batch_size))),
        )
        for row in rows
    ]
