"""`redline memory`'s result as rich tables: the step's memory by part, its largest modules, and each way to fit."""

from __future__ import annotations

from rich.table import Table

from redline.memory.fit import Fit, MemoryFit

GIB = 2**30


def memory_tables(result: MemoryFit) -> list[Table]:
    """The breakdown of the first row's estimate, its largest modules, and every row against the device."""
    first = result.rows[0].estimate
    kernel = f", {first.attention} attention" if first.attention != "auto" else ""
    parts = titled_table(f"{result.task}: one training step at batch {first.batch_size}, {first.precision}{kernel}")
    parts.add_column("part")
    parts.add_column("memory", justify="right")
    for name, count in (
        ("parameters", first.params),
        ("buffers", first.buffers),
        ("gradients (at the peak)", first.gradients),
        ("optimizer state", first.optimizer_state),
        ("activations and temporaries", first.activations),
        ("workspace allowance", first.workspace),
        ("total peak", first.total),
    ):
        if count or name != "buffers":  # most models hold none worth a row
            parts.add_row(name, size(count))
    tables = [parts]
    if first.top_modules:
        top = titled_table("modules holding the most activations")
        top.add_column("module")
        top.add_column("memory", justify="right")
        for name, count in first.top_modules:
            top.add_row(name, size(count))
        tables.append(top)
    # said once where the device's name has it already (--mem-gib 23.54: "a 23.54 GiB GPU"); a host of 1.5 TB
    # reads "1536 GiB", not "1.54e+03 GiB"
    mem = result.mem_gib
    total = f"{mem:.4g} GiB" if mem < 1000 else f"{mem:.0f} GiB"
    said = "" if any(text in result.device for text in (total, f"{mem:.10g} GiB")) else f"{total}, "
    if result.free_gib is not None:  # a CPU's: the rows are weighed against what is free of it now
        said = f"{result.free_gib:.4g} GiB available now, of {total}; "
    fits = titled_table(f"on {result.device} ({said}{size(result.rows[0].available)} for tensors)")
    for column in ("way", "batch", "peak", "fits", "largest batch"):
        fits.add_column(column, justify="left" if column == "way" else "right")
    for row in result.rows:
        fits.add_row(
            row.label,
            str(row.estimate.batch_size),
            size(row.estimate.total),
            "n/a" if row.fits is None else "yes" if row.fits else "no",  # n/a: too little data, as a note says
            _largest(row),
        )
    tables.append(fits)
    return tables


def _largest(row: Fit) -> str:
    if not row.trains:
        return "n/a"
    if not row.largest_batch:
        return "none"
    if row.largest_batch != row.cap:
        return str(row.largest_batch)
    ranks = row.estimate.world_size  # the cap is then train_data's size rounded down to a multiple of the ranks
    accum = row.estimate.grad_accum  # and shared by a step's micro-batches
    steps = f" in {accum} micro-batches" if accum > 1 else ""
    if ranks == 1:
        return f"{row.largest_batch} (all of train_data{steps})"
    return f"{row.largest_batch} (train_data's most {ranks} ranks share evenly{steps})"


def titled_table(title: str) -> Table:
    """A table at least as wide as its title, which rich would otherwise wrap at the width of a narrow table."""
    return Table(title=title, title_justify="left", min_width=len(title))


def size(count: int) -> str:
    """Bytes in GiB, MiB or KiB, whichever keeps a small model's memory from reading as 0.0 MiB."""
    if count >= GIB:
        return f"{count / GIB:.2f} GiB"
    if count >= 2**20:
        return f"{count / 2**20:.1f} MiB"
    return f"{count / 2**10:.1f} KiB" if count >= 2**10 else f"{count} B"
