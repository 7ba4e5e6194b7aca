"""A bench's rows as a terminal table, best first within each batch size, with auto's Plan beside it."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from redline.render.memory import size as size_text


def bench_table(result: Mapping[str, Any]) -> Table:
    """Return the bench result (``BenchResult.to_dict()``) as a table, one row per configuration.

    Columns that would be empty or repeat another (tokens/s for class labels, the CPU speed-up when
    every row ran on the CPU or none did, compile time when nothing compiled) are left out, MFU shares
    a column with the matmul share, and the borders are light, so it fits 80 columns (a GPU's rows, or
    a CPU's with tokens/s; CPU and GPU rows with tokens/s are wider). A figure is never cut to "8,…":
    where the terminal is too narrow even so, the names wrap, and past that the
    table is printed wider than the terminal (``print_uncut``) rather than losing digits.
    """
    table = Table(
        title=Text(f"Bench of {result['task']}: {steps_told(result)}"),  # a task's name is text, not markup
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=0,
        pad_edge=False,
    )
    rows = [row for row in result["rows"] if not row["error"]]
    columns: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = [
        ("config", shown_name),
        ("samples/s", lambda r: _number(r["samples_per_s"])),
    ]
    if any(r["tokens_per_s"] for r in rows):
        columns.append(("tokens/s", lambda r: _number(r["tokens_per_s"])))
    columns += [
        ("p50/p90 ms", lambda r: f"{_ms(r['step_ms_p50'])}/{_ms(r['step_ms_p90'])}"),
        ("vs naive", lambda r: _times(r["speedup_naive"])),
    ]
    if any(r["device"] != "cpu" and r["speedup_cpu_fp32"] is not None for r in rows):  # a CPU naive row ran
        columns.append(("vs CPU fp32", lambda r: _times(r["speedup_cpu_fp32"])))
    if any(r["mfu"] is not None for r in rows):  # one column for both shares, as p50/p90: it fits 80 columns
        columns.append(("MFU/of matmul", lambda r: f"{_share(r['mfu'], 1)}/{_share(r['mfu_measured'])}"))
    else:
        columns.append(("of matmul", lambda r: _share(r["mfu_measured"], missing="n/a")))
    columns.append(("memory", lambda r: _bytes(r["peak_mem_bytes"])))
    if any(r.get("estimate_bytes") is not None for r in rows):
        columns.append(("estimate", lambda r: _bytes(r.get("estimate_bytes"))))
    if any(r["compile_s"] is not None for r in rows):  # "12/1,234" as p50/p90: a cell that never wraps
        columns.append(("compile/repaid", lambda r: _compile(r, rows)))
    columns.append(("loss", lambda r: "not finite" if diverged(r) else "" if r["loss"] is None else f"{r['loss']:.3g}"))
    caption = _notes(rows, isolated=bool(result.get("isolated")))
    for name, _ in columns:
        _add_column(table, name)
    for row in result["rows"]:
        if row["error"]:  # said under the table: in a figure's column, which never wraps, it would widen it
            table.add_row(row["name"], Text("failed", style="red"), *[""] * (len(columns) - 2))
            caption.append(f"\n{row['name']} failed: ", style="red")
            caption.append(row["error"])  # an error's `[...]` is text, not markup
        else:
            table.add_row(*(cell(row) for _, cell in columns))
    if caption:
        table.caption = caption
        table.caption_justify = "left"
    return table


DIVERGED = "the last step's loss was NaN or inf, so the row does not train as set, whatever its speed"


def diverged(row: Mapping[str, Any]) -> bool:
    """Whether a row that ran ended on a loss that is not finite (the bench keeps such a loss as None)."""
    return not row.get("error") and row.get("samples_per_s") is not None and "loss" in row and row["loss"] is None


def _notes(rows: list[Mapping[str, Any]], *, isolated: bool = False) -> Text:
    """What the table's columns mean where a header cannot say it: the shares' peaks, the memory, the compile cell."""
    notes = []
    if any(r["mfu"] is not None for r in rows):
        notes.append(f"MFU/of matmul: {SHARES_TOLD}")
    elif any(r["mfu_measured"] is not None for r in rows):
        notes.append(f"of matmul: {MATMUL_TOLD}")
    if any(r.get("peak_mem_kind") == "allocated" for r in rows):
        notes.append(
            "memory on a GPU: the row's own tensors at their peak (allocated) while it was built and warmed up"
        )
    if any(r.get("peak_mem_kind") == "resident" for r in rows):
        note = "memory on a CPU: the whole process's resident set at its peak"
        if isolated:
            note += f" ({ISOLATED_MEMORY})"
        if any(r.get("estimate_bytes") is not None for r in rows):
            note += "; the estimate counts the step's own tensors, as a GPU's allocator would"
        notes.append(note)
    if any(r["compile_s"] is not None for r in rows):
        notes.append(f"compile/repaid: {COMPILE_TOLD}")
    if any(r.get("compile_cached") for r in rows):
        notes.append(f"* beside a compile's seconds: {CACHED_TOLD}")
    notes += [trial_told(r) for r in rows if r.get("trial_s") is not None]
    if any(r.get("trial_s") is not None and r.get("trial_cached") for r in rows):
        notes.append(f"* beside a trial's seconds: {TRIAL_CACHED_TOLD}")
    if any(precision_label(r) != r["precision"] for r in rows):
        notes.append(f"fp32 (TF32): {TF32_TOLD}")
    if any(diverged(r) for r in rows):
        notes.append(f"loss not finite: {DIVERGED}")
    return Text("\n".join(notes))


def steps_told(result: Mapping[str, Any]) -> str:
    """The steps each row was timed for, and why they are not the steps asked where they differ."""
    steps, window, asked = result["steps"], result["window"], result.get("steps_asked")
    told = f"{steps} timed steps per row, in windows of {window}"
    if steps == 0:  # every row failed: the steps asked are no row's
        told = "no row was timed" + (f" ({asked} steps asked, in windows of {window})" if asked else "")
    if result.get("isolated"):
        told += ", each row in a process of its own"
    machine = result.get("machine") or {}
    if machine.get("busy"):  # other work took CPUs the rows' threads wanted: every row ran slower, not all alike
        told += (
            f"; other processes kept {machine.get('others_cpus')} CPUs busy meanwhile, fewer free than the rows' "
            "threads need, so the timings carry their load (a quiet machine's may rank the rows otherwise)"
        )
    if result.get("interrupted"):  # a Ctrl-C: the rows are the batch sizes finished before it
        estimating = result["interrupted"].endswith("while estimating memory")  # after every row was timed
        told += f"; {result['interrupted']}, so " + (
            "the estimates are missing" if estimating else "the batch sizes from it on are missing"
        )
    if result.get("stopped_early"):
        return told + f" (of {asked} asked: the time limit ended the timing early)"
    if asked is not None and asked != steps and steps:
        return told + f" ({asked} asked, rounded up to whole windows, two at least)"
    return told


def _add_column(table: Table, name: str) -> None:
    if name == "config":
        table.add_column(name, justify="left", overflow="fold", min_width=10)  # "bf16-mixed" whole
    else:  # a figure keeps all its digits; its header wraps between words, and before "/s" and "/repaid"
        header = name.replace(" ", "\n").replace("/s", "\n/s").replace("/repaid", "\n/repaid")
        table.add_column(header, justify="right", no_wrap=True)


def best_line(result: Mapping[str, Any]) -> str:
    """One line naming the fastest configuration of each batch size and what auto ran there."""
    lines = []
    rows = [r for r in result["rows"] if not r["error"] and r["samples_per_s"]]
    for size in dict.fromkeys(r["batch_size"] for r in rows):
        group = [r for r in rows if r["batch_size"] == size]
        training = [r for r in group if not diverged(r)]
        if not training:
            lines.append(f"at batch {size} no configuration kept a finite loss: {DIVERGED}")
            continue
        best = max(training, key=lambda r: r["samples_per_s"])
        line = f"fastest at batch {size}: {best['name']}{_versus_naive(best)}"
        faster = [r["name"] for r in group if diverged(r) and r["samples_per_s"] > best["samples_per_s"]]
        if faster:
            line += f" (faster, but with a loss not finite: {', '.join(faster)})"
        for auto in (r for r in group if r["kind"] == "auto"):
            settings = _auto_settings(auto)
            share = auto["samples_per_s"] / best["samples_per_s"]
            line += f"\n{auto['name']} (what `redline train` runs: {settings}){_versus_naive(auto, ':')}"
            line += interval_told(auto)
            if diverged(auto):
                line += ", but its loss was not finite"
            else:
                line += ", the fastest" if auto is best else f", {share:.0%} of the fastest"
        lines.append(line)
    return "\n".join(lines)


def _versus_naive(row: Mapping[str, Any], lead: str = ",") -> str:
    """``, 1.20x the naive loop``; where no naive loop ran on its device and batch size (it failed: out of memory
    in fp32, say), that there is none to compare with, not "n/a the naive loop"."""
    if row["speedup_naive"] is None:
        return f"{lead} no naive loop ran to compare with"
    return f"{lead} {_times(row['speedup_naive'])} the naive loop"


def interval_told(row: Mapping[str, Any]) -> str:
    """`` (round by round: 1.41-1.47x, the median's 95% interval)``: where the row's median speed-up over the naive
    loop lies, from the rounds' paired windows ("" where too few rounds ran to say)."""
    interval = row.get("speedup_naive_interval")
    if not interval:
        return ""
    told = f" (round by round: {interval[0]:.2f}-{interval[1]:.2f}x, the median's 95% interval"
    speedup = row.get("speedup_naive")
    if speedup is not None and not interval[0] <= round(speedup, 2) <= interval[1]:  # as printed
        told += (
            f"; the median windows' {speedup:.2f}x lies outside it: the machine's speed changed while the rounds ran, "
            "so these figures are unsteady (run it again on a quiet machine, or with a larger --window)"
        )
    return told + ")"


def _auto_settings(auto: Mapping[str, Any]) -> str:
    """What the auto row ran: its precision, compile, CUDA graphs, layout and micro-batches, and whether a tuned Plan
    set them."""
    settings = f"{precision_label(auto)}, {'compiled' if auto['compile'] else 'eager'}"
    plan = auto.get("plan") or {}
    if (plan.get("cuda_graphs") or {}).get("value") is True:
        settings += ", CUDA graphs"
    if auto.get("channels_last"):
        settings += ", channels_last"
    accum = (plan.get("grad_accum") or {}).get("value") or 1
    if accum > 1:
        settings += f", {accum} micro-batches a step"
    if any(str(axis.get("reason", "")).startswith("tuned") for axis in plan.values()):
        settings = f"the tuned Plan: {settings}"
    return settings


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}"


def _ms(value: float | None) -> str:
    """Three significant digits, trailing zeros kept ("5.00", as "4.98" beside it), never "2.66e+03": from 100 ms
    on, whole milliseconds ("2660"; paired as "1076/1331", a thousands comma would only widen the column)."""
    if value is None:
        return "n/a"
    digits = f"{value:#.3g}"
    return f"{value:.0f}" if value >= 100 or digits.endswith(".") else digits  # 99.96: "100", not "100."


def _share(value: float | None, decimals: int = 0, missing: str = "-") -> str:
    return missing if value is None else percent(value, decimals)


def percent(share: float, decimals: int = 0) -> str:
    """``share`` as a percentage with ``decimals`` decimals; one too small for them keeps its first digit
    ("0.04%"): a small model on a CPU reaches a fraction of a percent of its matmul, and "0%" reads as nothing."""
    if 0 < share * 100 < 0.5 / 10**decimals:
        decimals = -math.floor(math.log10(share * 100))
    return f"{share * 100:.{decimals}f}%"


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _bytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    return size_text(value)


SHARES_TOLD = (
    "the achieved FLOP/s as a share of the catalog's dense peak for the GPU in the row's precision, and of a square "
    "matmul's FLOP/s timed on the device in that precision"
)
MATMUL_TOLD = "the achieved FLOP/s as a share of a square matmul's FLOP/s timed on the device in the row's precision"
COMPILE_TOLD = (
    "the seconds the compile took/the steps whose time saved against the eager row of its precision repays "
    "them (never: the compiled step is not faster; -: no eager row to compare; kept eager: the run's check compiled "
    "the model, then kept the eager one, as the compiled was not faster, so the compile is paid and never repaid)"
)
ISOLATED_MEMORY = "each row's own process: torch, the data and the row"  # a CPU row's memory under --isolate
KEPT_EAGER = "kept eager"  # a compile paid, then dropped: in the compile cell, and the page's repaid steps
CACHED_TOLD = (
    "torch's on-disk compile caches, which an earlier process filled, served the compile: the next run here pays as "
    "little, a cold compile more (run with TORCHINDUCTOR_CACHE_DIR set to a new empty folder to time one)"
)


def _compile(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """Compile seconds and their break-even in steps, which needs an eager row of the same precision to compare
    with: "12/1,234", "12/never", "3.0/-"; "0.3*/10" where torch's on-disk caches served the compile."""
    if row["compile_s"] is None:
        return ""
    repaid = repaid_after(row, rows)
    seconds = row["compile_s"]
    cached = "*" if row.get("compile_cached") else ""  # a mark, not a word: the cell stays narrow (under the table)
    return f"{seconds:.0f}{cached}/{repaid}" if seconds >= 10 else f"{seconds:.1f}{cached}/{repaid}"


def repaid_after(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """A compiled row's break-even as a person reads it: its steps ("1,234"), "never" (the compiled step is not
    faster than the eager row of its precision), "-" (no such eager row to compare with), or "kept eager" (a
    compile the run's check paid, then dropped)."""
    steps = row.get("break_even_steps")
    if steps is not None:  # the first whole step by which the time saved repays the compile: 11.17 is 12, not 11
        return f"{math.ceil(steps - 1e-9):,}"
    if row.get("compile") is False:  # an auto row whose check compiled, then kept the eager model
        return KEPT_EAGER
    same = ("device", "precision", "batch_size")
    eager = any(
        r["kind"] == "explicit" and r["compile"] is False and r["step_ms_p50"] and all(r[k] == row[k] for k in same)
        for r in rows
    )
    return "never" if eager else "-"


def precision_label(row: Mapping[str, Any]) -> str:
    """A row's precision as it ran: "fp32 (TF32)" where its Plan let fp32's matmuls run in TF32 (a GPU from Ampere
    on), which the naive loop's true fp32 does not; else the precision as the row names it."""
    tf32 = ((row.get("plan") or {}).get("tf32") or {}).get("value")
    return "fp32 (TF32)" if row.get("precision") == "fp32" and tf32 is True else str(row.get("precision"))


def shown_name(row: Mapping[str, Any]) -> str:
    """A row's name with its precision as it ran: "cuda fp32 (TF32) eager b64" (the name itself stays the key)."""
    label = precision_label(row)
    if label == row.get("precision"):
        return str(row["name"])
    return " ".join(label if part == row["precision"] else part for part in str(row["name"]).split(" "))


def trial_told(row: Mapping[str, Any]) -> str:
    """What a row's precision trial cost before its first step, and where the bench counts it."""
    cached = "*" if row.get("trial_cached") else ""
    told = f"{shown_name(row)}'s precision trial: {row['trial_s']:.1f}{cached} s before its first step"
    return told + (", counted in its repaid steps" if row.get("compile") and row.get("compile_s") is not None else "")


TRIAL_CACHED_TOLD = (
    "redline's trial cache, which an earlier run here filled, served the precision trial: the next run here pays as "
    "little, a fresh machine the whole trial (run with REDLINE_CACHE_DIR set to a new empty folder to time one)"
)
TF32_TOLD = (
    "the row's fp32 matmuls ran in TF32 (a 10-bit mantissa, on Ampere GPUs and later, as `redline train` runs them), "
    "while the naive loop's ran in true fp32, torch's default"
)
