"""A profile (``Profile.to_dict()``) for the terminal: the phases of a step, the heaviest operators, the advice."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from redline.render.memory import size as size_text


def phases_table(profile: Mapping[str, Any]) -> Table:
    """Each phase's host time per step and share; on a GPU, its kernels' time too."""
    breakdown = profile["breakdown"]
    table = Table(title=Text("Phases of a step"), title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("phase", style="bold", no_wrap=True)
    table.add_column("host ms/step", justify="right", no_wrap=True)
    table.add_column("of step", justify="right", no_wrap=True)  # its share of the step's host time
    on_gpu = breakdown["device_busy"] is not None
    if on_gpu:
        table.add_column("GPU ms/step", justify="right", no_wrap=True)
    for phase in breakdown["phases"]:
        cells = [phase["name"], f"{phase['host_ms']:.3f}", f"{phase['share']:.1%}"]
        if on_gpu:
            cells.append(f"{phase['device_ms']:.3f}")
        table.add_row(*(Text(cell) for cell in cells))
    return table


def ops_table(profile: Mapping[str, Any]) -> Table:
    """The operators with the most self time per step."""
    where = "GPU" if profile["ops_on"] == "gpu" else "host"
    table = Table(title=Text(f"Heaviest operators ({where} self time)"), title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("operator")
    for name in ("ms/step", "calls/step", "of all"):  # its share of every operator's self time
        table.add_column(name, justify="right", no_wrap=True)
    for op in profile["ops"]:
        table.add_row(Text(_short(op["name"])), f"{op['self_ms']:.3f}", f"{op['calls']:.3g}", f"{op['share']:.1%}")
    return table


OP_NAME_CHARS = 44  # a row per operator in 80 columns; a compiled graph's name ends in a long hash


def _short(name: str) -> str:
    """``name``, cut to ``OP_NAME_CHARS`` with an ellipsis: wrapped, it would take three lines of the table."""
    return name if len(name) <= OP_NAME_CHARS else name[: OP_NAME_CHARS - 1] + "…"


def header_line(profile: Mapping[str, Any]) -> str:
    """What was profiled: the task, the setting, the steps and their mean time."""
    breakdown = profile["breakdown"]
    return (
        f"Profile of {profile['task']} ({profile['setting']}): {breakdown['steps']} steps recorded, "
        f"{breakdown['step_ms']:.2f} ms each"
    )


def summary_lines(profile: Mapping[str, Any]) -> list[str]:
    """The figures beside the tables (device busy, TFLOP/s, peak memory, the trace) and the advice."""
    lines = []
    busy = profile["breakdown"]["device_busy"]
    if busy is not None:
        lines.append(f"GPU busy: {busy:.0%} of the steps' wall time")
    if profile["tflops"]:
        lines.append(f"achieved: {profile['tflops']:.3g} TFLOP/s (the profiler's overhead included)")
    elif profile["flops_per_step"] == 0:
        lines.append("achieved: n/a (no matmul or convolution FLOPs were counted: the step's work is elementwise)")
    else:  # said, not left out: a missing line reads as a figure forgotten
        lines.append(
            "achieved: n/a (the FLOPs are counted on meta tensors, where this step does not run: a .item() or "
            "another data-dependent branch, say)"
        )
    if profile["peak_memory_bytes"]:
        kind = "allocated" if profile["peak_memory_kind"] == "allocated" else "the process's resident set"
        lines.append(f"peak memory while warming up: {size_text(profile['peak_memory_bytes'])} ({kind})")
    lines += [f"advice: {line}" for line in profile["advice"]]
    if profile["trace"]:
        lines.append(f"trace: {profile['trace']} (open it in ui.perfetto.dev or chrome://tracing)")
    return lines
