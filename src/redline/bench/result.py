"""A bench's result as data: one row of figures per configuration, and what they ran on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redline.brief import brief

if TYPE_CHECKING:
    from redline.plan import Plan


@dataclass(frozen=True)
class BenchRow:
    """One configuration's figures; on failure, ``error`` says why and the figures are None."""

    name: str
    kind: str
    device: str
    precision: str
    compile: bool | None
    channels_last: bool | None
    batch_size: int
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_ms_p50: float | None = None
    step_ms_p90: float | None = None
    peak_mem_bytes: int | None = None
    peak_mem_kind: str = ""  # "allocated": the row's own on a GPU; "resident": the whole process's on a CPU
    estimate_bytes: int | None = None  # the step's peak predicted before the run (the ``estimate`` given)
    tflops: float | None = None
    mfu: float | None = None  # achieved FLOP/s over the datasheet's dense peak (GPUs in the catalog)
    mfu_measured: float | None = None  # over a matmul measured on this device in the row's precision
    compile_s: float | None = None
    compile_cached: bool | None = None  # the compile was served from torch's on-disk caches: less than a cold one's
    trial_s: float | None = None  # auto's precision trial before the row ran (None: no trial was asked)
    trial_cached: bool | None = None  # the trial was read from redline's trial cache: a fresh machine pays it
    # the first step's seconds, less any compile in it: the one-off work (kernels built, memory taken) a run pays
    # once, as its trial and compile are; a row after others in one process may find theirs done
    first_step_s: float | None = None
    break_even_steps: float | None = None  # steps after which the compile (and the trial) has paid for itself
    speedup_naive: float | None = None  # over the naive loop on the same device and batch size
    speedup_naive_interval: tuple[float, float] | None = None  # where its median lies, 95% (paired rounds)
    speedup_cpu_fp32: float | None = None  # over the naive loop on the CPU
    loss: float | None = None  # of step ``loss_step``, after the timing (its micro-batches' mean); None: not finite
    loss_step: int | None = None  # the optimizer step ``loss`` is of: the same for every row of a batch size
    plan: dict[str, dict[str, Any]] | None = None
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BenchResult:
    """A bench's rows, with what they ran on."""

    task: str
    steps: int  # timed steps per row: the fewest of any batch size, where --max-seconds stopped one early; 0: none ran
    window: int
    measured_at: str
    machine: dict[str, Any]
    versions: dict[str, str]
    rows: tuple[BenchRow, ...]
    steps_asked: int | None = None  # the ``steps`` given: ``steps`` differs where whole windows round it up
    stopped_early: bool = False  # ``max_seconds`` ended the timing before every round ran
    interrupted: str = ""  # where a Ctrl-C stopped the bench; its rows are the batch sizes finished before
    isolated: bool = False  # each row ran in a process of its own

    def __repr__(self) -> str:
        rows = ", ".join(f"{row.name!r}: {_row_said(row)}" for row in self.rows)
        return brief(self, ("task", "steps", "interrupted")[: 3 if self.interrupted else 2], rows=f"{{{rows}}}")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rows"] = [row.to_dict() for row in self.rows]
        return data

    def row(self, name: str) -> BenchRow:
        """The row called ``name``."""
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(name)


def _row_said(row: BenchRow) -> str:
    """A row's figure in a BenchResult's repr: samples/s and its speed-up over the naive loop, or that it failed."""
    if row.samples_per_s is None:
        return "failed"
    return f"{row.samples_per_s:.4g}/s" + (f" ({row.speedup_naive:.2f}x naive)" if row.speedup_naive else "")


Peaks = dict[tuple[str, str | None, bool], float | None]  # measured matmul TFLOP/s by (device, precision, TF32)


@dataclass(frozen=True)
class RowFacts:
    """What a row's figures read from its runner once timed, where the runner lives (this process, or the row's own
    under ``isolate``): its Plan, compile and trial, the first batch's tokens, the precision its matmuls run in and
    their measured peak, and why it ran eagerly where it was to compile ("" when it did not)."""

    plan: Plan | None
    compile_s: float | None
    compile_cached: bool | None
    trial_s: float | None
    trial_cached: bool | None
    first_step_s: float | None
    steps_run: int  # optimizer steps run so far: warm-up and timing
    micro_steps: int
    tokens: int | None  # of the first batch, as its samples are: each row's batches are alike
    matmuls: str | None
    matmul_peak: float | None
    eager: str

    @property
    def tf32(self) -> bool:
        """Whether the row's fp32 matmuls ran in TF32: ``uses_tf32`` of its Plan."""
        return uses_tf32(self.plan)


def uses_tf32(plan: Plan | None) -> bool:
    """Whether a row with ``plan`` runs its fp32 matmuls in TF32 (its Plan's choice); the naive loop, which has no
    Plan, never does."""
    return bool(plan.tf32.value) if plan is not None else False
