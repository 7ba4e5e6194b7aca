"""A bench's rows as a terminal table, best first within each batch size, with auto's Plan beside it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.table import Table


def bench_table(result: Mapping[str, Any]) -> Table:
    """Return the bench result (``BenchResult.to_dict()``) as a table, one row per configuration."""
    table = Table(
        title=f"Bench of {result['task']}: {result['steps']} timed steps per row, in windows of {result['window']}",
        title_justify="left",
    )
    for name, justify in (
        ("configuration", "left"), ("samples/s", "right"), ("tokens/s", "right"), ("step p50 / p90 ms", "right"),
        ("vs naive", "right"), ("vs CPU fp32", "right"), ("MFU", "right"), ("peak memory", "right"),
        ("compile", "right"), ("loss", "right"),
    ):  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in result["rows"]:
        if row["error"]:
            table.add_row(row["name"], f"[red]failed: {row['error']}[/red]", *[""] * 8)
            continue
        table.add_row(
            row["name"],
            _number(row["samples_per_s"]),
            _number(row["tokens_per_s"]),
            f"{_ms(row['step_ms_p50'])} / {_ms(row['step_ms_p90'])}",
            _times(row["speedup_naive"]),
            _times(row["speedup_cpu_fp32"]),
            _mfu(row),
            _bytes(row["peak_mem_bytes"], row.get("peak_mem_kind", "")),
            _compile(row),
            "" if row["loss"] is None else f"{row['loss']:.4g}",
        )
    return table


def best_line(result: Mapping[str, Any]) -> str:
    """One line naming the fastest configuration of each batch size and what auto ran there."""
    lines = []
    rows = [r for r in result["rows"] if not r["error"] and r["samples_per_s"]]
    for size in dict.fromkeys(r["batch_size"] for r in rows):
        group = [r for r in rows if r["batch_size"] == size]
        best = max(group, key=lambda r: r["samples_per_s"])
        line = f"fastest at batch {size}: {best['name']}, {_times(best['speedup_naive'])} the naive loop"
        for auto in (r for r in group if r["kind"] == "auto"):
            settings = f"{auto['precision']}, {'compiled' if auto['compile'] else 'eager'}"
            share = auto["samples_per_s"] / best["samples_per_s"]
            line += f"; {auto['name']} ran {settings} at {share:.0%} of it ({_times(auto['speedup_naive'])} naive)"
        lines.append(line)
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _mfu(row: Mapping[str, Any]) -> str:
    parts = []
    if row["mfu"] is not None:
        parts.append(f"{row['mfu']:.1%}")
    if row["mfu_measured"] is not None:
        parts.append(f"{row['mfu_measured']:.0%} of matmul")
    return ", ".join(parts) or "n/a"


def _bytes(value: int | None, kind: str) -> str:
    if value is None:
        return "n/a"
    text = f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"
    return f"{text} (process)" if kind == "resident" else text


def _compile(row: Mapping[str, Any]) -> str:
    if row["compile_s"] is None:
        return ""
    steps = row["break_even_steps"]
    repaid = "never repaid" if steps is None else f"repaid after {steps:,.0f} steps"
    return f"{row['compile_s']:.1f} s, {repaid}"
