"""The doctor's report as rich tables: the checks with their fixes, then the devices with their figures."""

from __future__ import annotations

from collections import Counter

from rich import box
from rich.table import Table
from rich.text import Text

from redline.doctor.checks.measured import flops
from redline.doctor.report import DeviceReport, DoctorReport

STATUS_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def checks_table(report: DoctorReport) -> Table:
    """Return one row per check: id, status, and the detail followed by the fix of each warn or fail.

    The fix shares the widest column and the table has no vertical rules, so a long command that
    wraps still copies out of the terminal without border characters in it.
    """
    table = Table(title="redline doctor", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("check", style="bold", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail and fix")
    for check in report.checks:
        # Text, not markup: a fix such as `pip install 'pkg[extra]'` must print exactly as written.
        cell = Text(check.detail, style="dim" if check.status == "skip" else "")
        if check.fix:
            cell.append("\nfix: ", style="bold").append(check.fix, style="cyan")
        table.add_row(check.id, Text(check.status, style=STATUS_STYLE[check.status]), cell)
    return table


def devices_table(report: DoctorReport) -> Table:
    """Return the devices with what was measured on them; the figures never wrap, the name does."""
    table = Table(title="Devices", title_justify="left")
    for column in ("device", "name", "memory", "matmul", "host-to-device"):
        table.add_column(column, no_wrap=column != "name", min_width=16 if column == "name" else None)
    for device in report.devices:
        table.add_row(device.id, _name(device), _memory(device), _matmul(device), _h2d(device))
    return table


def summary_line(report: DoctorReport) -> Text:
    counts = Counter(check.status for check in report.checks)
    parts = [f"{counts[status]} {status}" for status in ("ok", "warn", "fail", "skip") if counts[status]]
    verdict = "fix the failed checks above" if report.exit_code else "nothing failed"
    return Text(f"{', '.join(parts)}: {verdict}", style="bold red" if report.exit_code else "bold green")


def _name(device: DeviceReport) -> str:
    if device.arch:  # an AMD GPU: its target says what the wheel must hold (gfx942), not a CUDA capability
        name = f"{device.name} ({device.arch})"
    else:
        name = device.name + (f" (sm {device.capability})" if device.capability else "")
    return f"{name}: torch cannot see it" if device.usable is False else name


def _memory(device: DeviceReport) -> str:
    return f"{device.mem_gib:.1f} GiB" if device.mem_gib else ""


def _matmul(device: DeviceReport) -> str:
    if device.error:
        return "failed (see device-smoke)"
    if device.correct is False:
        return "WRONG RESULT"
    figures = [f"fp32 {flops([device.fp32_tflops])}"] if device.fp32_tflops else []
    if device.lowp_tflops:
        figures.append(f"{device.lowp_dtype} {flops([device.lowp_tflops])}")
    return ", ".join(figures) or ("correct" if device.correct else "not measured")


def _h2d(device: DeviceReport) -> str:
    if device.h2d_pinned_gbps is None or device.h2d_pageable_gbps is None:
        return ""
    return f"pageable {device.h2d_pageable_gbps:g} GB/s, pinned {device.h2d_pinned_gbps:g} GB/s"
