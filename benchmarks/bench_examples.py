"""`redline bench` on the built-in examples, written as a results table: is auto the fastest, and never slower?

For each task the bench times the naive loop, fp32 and the device's fast reduced precision, each
eager and compiled, and auto, side by side in rotating windows (see docs/bench.md). The verdict
lines compare auto with the fastest explicit row at steady state (goal: within 5%), with every
row over the task's own planned run, compile, auto's precision trial and its first step included, and with the
naive loop (goal: never slower). Rows that run the same configuration (auto and the explicit row
it chose) show how much of a difference is noise.

    python benchmarks/bench_examples.py [--tasks example:digits,example:chargpt] [--steps 200] [--window 10]
                                        [--device cpu] [--planned-steps N] [--isolate] [--write bench-cpu]
"""

from __future__ import annotations

import argparse
import json

import environment
import redline
from redline.bench import benchmark
from redline.bench.run import task_steps
from redline.render.bench import CACHED_TOLD, TF32_TOLD, TRIAL_CACHED_TOLD, precision_label


def table(result: redline.BenchResult) -> list[str]:
    lines = [
        "| row | precision | compile | samples/s | step p50 / p90 ms | vs naive | of matmul peak | compile s "
        "| trial s | break-even steps | loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result.rows:
        label = precision_label(r.to_dict())
        if r.error:
            lines.append(f"| {r.name} | {label} | {r.compile} | failed: {r.error} | | | | | | | |")
            continue
        lines.append(
            f"| {r.name} | {label} | {'yes' if r.compile else 'no'} | {r.samples_per_s:,.0f} "
            f"| {r.step_ms_p50:.3g} / {r.step_ms_p90:.3g} | **{r.speedup_naive:.3f}x**{spread(r)} "
            f"| {'' if r.mfu_measured is None else f'{r.mfu_measured:.0%}'} "
            f"| {seconds(r.compile_s, r.compile_cached)} | {seconds(r.trial_s, r.trial_cached)} "
            f"| {'' if r.break_even_steps is None else f'{r.break_even_steps:,.0f}'} | {r.loss:.4g} |"
        )
    return [*lines, *footnotes([r.to_dict() for r in result.rows if not r.error])]


def spread(row: redline.bench.BenchRow) -> str:
    """ " (0.94-1.02)": where the median of the row's round-by-round speed-up lies, 95% (docs/bench.md)."""
    interval = row.speedup_naive_interval
    return f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else ""


def seconds(value: float | None, cached: bool | None) -> str:
    """A compile's or a trial's seconds, "0.3*" where a cache an earlier process filled served it."""
    return "" if value is None else f"{value:.1f}{'*' if cached else ''}"


def footnotes(rows: list[dict]) -> list[str]:
    """What a table's marks mean, as `redline bench` says them under its own: cached seconds, fp32 run in TF32."""
    notes = []
    if any(r["compile_s"] is not None and r["compile_cached"] for r in rows):
        notes.append(f"- `*` beside a compile's seconds: {CACHED_TOLD}.")
    if any(r["trial_s"] is not None and r["trial_cached"] for r in rows):
        notes.append(f"- `*` beside a trial's seconds: {TRIAL_CACHED_TOLD}.")
    if any(precision_label(r) != r["precision"] for r in rows):
        notes.append(f"- fp32 (TF32): {TF32_TOLD}.")
    return ["", *notes] if notes else []


def planned_run(result: redline.BenchResult, planned: int) -> list[str]:
    """Each row's time for the task's own run (compile + auto's trial + its first step + the other planned steps x
    its p50 step), and auto's share of the best. The first step is each row's own: its one-off work (kernels built,
    memory taken) is paid by every row, auto's partly in its trial."""
    rows = [r for r in result.rows if not r.error and r.kind != "naive"]

    def total(r: redline.bench.BenchRow) -> float:
        step = r.step_ms_p50 / 1e3
        first = r.first_step_s if r.first_step_s is not None else step
        return (r.compile_s or 0.0) + (r.trial_s or 0.0) + first + (planned - 1) * step

    def paid(r: redline.bench.BenchRow) -> str:  # the one-off parts of its total
        parts = [] if r.first_step_s is None else [f"first step {r.first_step_s:.2f} s"]
        parts += [] if r.trial_s is None else [f"trial {seconds(r.trial_s, r.trial_cached)} s"]
        return f" ({', '.join(parts)} included)" if parts else ""

    best = min(rows, key=total)
    auto = next(r for r in rows if r.kind == "auto")
    told = "; ".join(f"{r.name} {total(r):.1f} s{paid(r)}" for r in sorted(rows, key=total))
    share = total(best) / total(auto)
    return [
        f"- for the task's own run of {planned} steps, compile, auto's trial and each row's first step included: "
        f"{told}. Auto takes "
        f"{share:.1%} of the best's speed (goal: >= 95%, {'met' if share >= 0.95 else 'NOT met'})."
    ]


def runs_alike(row: redline.bench.BenchRow, auto: redline.bench.BenchRow) -> bool:
    """Whether an explicit row runs auto's configuration: explicit rows take each batch whole, so a
    micro-batched auto (a tuned Plan's gradient accumulation) has no twin among them."""
    micro_batches = (auto.plan or {}).get("grad_accum", {}).get("value", 1)
    alike = (row.precision, row.compile, row.channels_last) == (auto.precision, auto.compile, auto.channels_last)
    kernels = [(r.plan or {}).get("attention", {}).get("value") for r in (row, auto)]  # explicit rows: torch's pick
    return alike and micro_batches == 1 and kernels[0] == kernels[1]


def _kernel(row: redline.bench.BenchRow) -> str:
    """ " with KERNEL attention" where the row's attention kernel is not torch's pick."""
    kernel = (row.plan or {}).get("attention", {}).get("value", "default")
    return "" if kernel == "default" else f" with {kernel} attention"


def verdict(result: redline.BenchResult) -> list[str]:
    rows = [r for r in result.rows if not r.error]
    auto = next(r for r in rows if r.kind == "auto")
    explicit = [r for r in rows if r.kind == "explicit"]
    fastest = max(explicit, key=lambda r: r.samples_per_s)
    twin = next((r for r in explicit if runs_alike(r, auto)), None)  # the explicit row that runs what auto chose
    share = auto.samples_per_s / fastest.samples_per_s
    interval = auto.speedup_naive_interval  # where its round-by-round median lies: below 1 only if truly slower
    slower = interval[1] < 1 if interval else auto.speedup_naive < 1
    never_slower = "NOT met" if slower else "met" if auto.speedup_naive >= 1 else "met: not measurably slower"
    rounds = f" (round by round: {interval[0]:.3f}-{interval[1]:.3f}x, the median's 95% interval)" if interval else ""
    near_fastest = "met" if share >= 0.95 else "NOT met"
    lines = [
        f"- auto ran {precision_label(auto.to_dict())}{_kernel(auto)}, {'compiled' if auto.compile else 'eager'}: "
        f"**{auto.speedup_naive:.3f}x** the naive loop{rounds} (goal: >= 1, {never_slower}); "
        f"{share:.1%} of the fastest explicit row, {fastest.name} (goal: >= 95%, {near_fastest}).",
        f"- auto's precision: {auto.plan['precision']['reason']}" if auto.plan else "",
        f"- auto's compile: {auto.plan['compile']['reason']}" if auto.plan else "",
    ]
    if twin is not None:
        lines.append(
            f"- noise: auto and {twin.name} run the same configuration; they measured "
            f"{auto.samples_per_s / twin.samples_per_s:.3f}x of each other."
        )
    return [line for line in lines if line]


ISOLATED = (
    ", each row in a process of its own (`--isolate`: its own memory allocator and compile caches; its CPU "
    "memory its own process's)"
)


def load(result: redline.BenchResult) -> str:
    """What other processes took of the CPUs while the task's bench ran (hardware/contention.py)."""
    others = result.machine.get("others_cpus")
    if others is None:
        return "- Other processes' load on the CPUs: not read (no /proc, or REDLINE_CONTENTION=off)."
    busy = "fewer free than the rows' threads need: the timings carry it" if result.machine.get("busy") else "quiet"
    return f"- Other processes kept {others:g} CPUs busy while this bench ran ({busy})."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="example:digits,example:chargpt")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--planned-steps", type=int, default=None, help="the run auto plans for (default: the task's)")
    parser.add_argument("--isolate", action="store_true", help="each row in a process of its own (docs/bench.md)")
    parser.add_argument("--json", default=None, help="also write every result as JSON to this file")
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    body = [
        f"`redline bench` per task: {args.steps} timed steps per row in windows of {args.window}, rows taking "
        f"turns in rotating rounds after a warm-up window each{ISOLATED if args.isolate else ''}. samples/s is the "
        "median window; speed-ups "
        "are against the naive loop's median in the same run (in brackets, the 95% interval of the median of "
        "the round-by-round speed-ups). Peak memory is left out here: on a CPU it "
        "is the whole process's (see the JSON).",
        "",
    ]
    results = []
    for spec in args.tasks.split(","):
        task = redline.load_task(spec)
        result = benchmark(
            task, devices=args.device, steps=args.steps, window=args.window, planned_steps=args.planned_steps,
            isolate=args.isolate,
        )  # fmt: skip
        results.append(result.to_dict())
        planned = args.planned_steps or task_steps(task, task.batch_size) or 1000
        body += [f"### `{spec}` at batch {task.batch_size}", "", *table(result), "", *verdict(result), load(result)]
        body += [*planned_run(result, planned), ""]
        print("\n".join(body[-12:]), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    environment.publish(args.write, "redline bench on the built-in examples", body, args.device)


if __name__ == "__main__":
    main()
