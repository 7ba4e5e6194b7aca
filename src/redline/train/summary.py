"""TrainSummary: what a training run produced, as data for the terminal, JSON and the report."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from redline.plan import Plan


@dataclass(frozen=True, kw_only=True)
class TrainSummary:
    """What a training run produced: the Plan it ran with and the numbers that describe it."""

    task: str
    device: str
    plan: Plan
    steps: int
    epochs: float | None  # None when the data is a stream: an epoch's length is unknown
    samples: int
    final_loss: float | None  # None when no step ran
    val_loss: float | None
    val_metric: float | None
    samples_per_s: float | None  # None when no step ran after the first
    tokens_per_s: float | None
    train_seconds: float
    compile_seconds: float | None
    flops_per_step: int | None
    mfu: float | None
    mfu_peak_tflops: float | None
    measured_peak_ratio: float | None
    skipped_steps: int
    stopped: str
    resumed_from: str | None
    checkpoint: str | None
    sample: str | None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainSummary:
        """Read back ``to_dict()``'s data (a run's summary.json); a figure it lacks reads as None."""
        names = {f.name for f in fields(cls)}
        known: dict[str, Any] = {name: data.get(name) for name in names}
        known["plan"] = Plan.from_dict(data.get("plan") or {})
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        """Return the summary as JSON-ready data."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["plan"] = self.plan.to_dict()
        return data
