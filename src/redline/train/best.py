"""Keeping the best evaluation's weights (``keep_best``): OUT/best.safetensors, and best.json saying which.

Each evaluation that improves on the best so far (the lowest val_loss, or the highest val_metric:
a Task's metric is higher-is-better) writes the whole weights, as ``model.safetensors`` is
written, and then ``best.json`` with the metric, its value and the step. Every rank agrees: the
metrics are the job's (summed over the ranks), and under FSDP writing the weights is collective.

A checkpoint stores the best so far, so a resumed run only replaces the file with better weights.
An evaluation after that checkpoint, in the part of the run a crash lost, may have written
better weights still; its best.json (of the same metric, at a later step) then stands as the best.
A run resumed into a new out_dir copies the checkpoint's best there, or, where the old out_dir's file
now holds a later best, starts afresh.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from redline.atomic import write_or_refuse
from redline.errors import TrainingError
from redline.parallel.collectives import run_on_rank0
from redline.runtime.runtime import Runtime
from redline.train.output import write_json

log = logging.getLogger("redline")

WEIGHTS = "best.safetensors"
RECORD = "best.json"
NO_SPACE = "free space on that disk (or make it writable again), then resume again"
Monitor = Literal["val_loss", "val_metric"]


def best_weights(keep_best: str, out_dir: Path | None) -> BestWeights | None:
    """A fresh BestWeights for ``keep_best`` (TrainerConfig's), or None when it is "off" (or nothing is written)."""
    if keep_best not in ("val_loss", "val_metric") or out_dir is None:
        return None
    return BestWeights("val_loss" if keep_best == "val_loss" else "val_metric", out_dir)


@dataclass
class BestWeights:
    """The best evaluation so far by ``monitor``, and where its weights are."""

    monitor: Monitor
    out_dir: Path
    value: float | None = None
    step: int | None = None
    _told_not_finite: bool = field(default=False, repr=False, compare=False)

    @property
    def path(self) -> Path:
        return self.out_dir / WEIGHTS

    def better(self, value: float | None) -> bool:
        """Whether ``value`` of the monitored metric improves on the best (a NaN or a missing value never does)."""
        if value is None or not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value < self.value if self.monitor == "val_loss" else value > self.value

    def offer(self, rt: Runtime, metrics: dict[str, float | None], step: int, *, main: bool) -> bool:
        """Write the weights and best.json when this evaluation is the best so far; return whether it was.

        Collective (under FSDP the weights are gathered); ``main``: whether this rank writes best.json.
        """
        value = metrics.get(self.monitor)
        if value is not None and not math.isfinite(value) and main and not self._told_not_finite:
            self._told_not_finite = True  # once a run: every evaluation of a broken metric would say it again
            what = "task.metric" if self.monitor == "val_metric" else "task.loss_fn on val_data"
            log.warning(
                "--keep-best %s: the evaluation at step %d gave %s, which is never the best, so %s is not written "
                "for it (nor for any evaluation that is not finite)\nhint: look for NaN or inf in %s and val_data",
                self.monitor, step, value, self.path.name, what,
            )  # fmt: skip
        if not self.better(value):
            return False
        rt.save_weights(self.path)  # the weights first: a crash between the two leaves the older record
        self.value, self.step = value, step
        if main:
            write_json(self.out_dir / RECORD, self.to_dict())
        return True

    def to_dict(self) -> dict[str, Any]:
        """The record best.json holds, the checkpoint stores, and the summary reports."""
        return {"monitor": self.monitor, "value": self.value, "step": self.step, "path": str(self.path)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Go on from a checkpoint's best, or from a later best.json of this run (see the module's docstring).

        A best of another metric, or none, starts afresh: the next evaluation writes the file.
        """
        if not state or state.get("monitor") != self.monitor or state.get("value") is None:
            self.value, self.step = None, None
            return
        self.value, self.step = float(state["value"]), int(state["step"])
        stored = Path(state.get("path") or self.path)  # another run's out_dir, where a resume branches into a new one
        if not run_on_rank0(functools.partial(self._bring, stored), f"copying {stored} into {self.out_dir}"):
            self.value, self.step = None, None
            return
        later = run_on_rank0(self._read_record, "reading best.json") or {}
        ours = later.get("monitor") == self.monitor and later["step"] >= self.step
        if ours and (later["value"] == self.value or self.better(later["value"])):
            self.value, self.step = float(later["value"]), int(later["step"])

    def _bring(self, stored: Path) -> bool:
        """Whether the checkpoint's best weights (at ``stored``) are at ``self.path``: copied there, with best.json,
        from another run's out_dir where need be; False where they are lost (a later best replaced them there)."""
        elsewhere = stored.resolve() != self.path.resolve()
        if elsewhere and self._holds_ours(self._read_record(stored.parent)):
            # the run goes on in a new out_dir; the old one's file holds the checkpoint's best, not a later one
            write_or_refuse(self.path, functools.partial(_copy, stored), error=TrainingError, hint=NO_SPACE)
            write_json(self.out_dir / RECORD, self.to_dict())
            return True
        if (not elsewhere and self.path.is_file()) or self._holds_ours(self._read_record(), later=True):
            return True  # here, or here since the out_dir moved: of this step or a later one (load_state_dict picks)
        there = self._read_record(stored.parent) if elsewhere else None
        replaced = there is not None and there["monitor"] == self.monitor and there["step"] > (self.step or 0)
        gone = f"were replaced there by a later best (of step {there['step']})" if replaced and there else "are gone"
        log.warning(
            "the checkpoint's best weights (%s, of step %s) %s: --keep-best starts afresh, and the next evaluation "
            "writes %s", stored, self.step, gone, self.path,
        )  # fmt: skip
        return False  # the summary must never name a missing file

    def _holds_ours(self, record: dict[str, Any] | None, *, later: bool = False) -> bool:
        """Whether best.json's ``record`` is of this best (of a ``later`` step too): its file holds those weights."""
        if not record or record["monitor"] != self.monitor or self.step is None:
            return False
        return record["step"] >= self.step if later else (record["step"], record["value"]) == (self.step, self.value)

    def _read_record(self, out_dir: Path | None = None) -> dict[str, Any] | None:
        """best.json beside best.safetensors (in this ``out_dir``), or None where either is missing or the record is
        unreadable."""
        out_dir = out_dir or self.out_dir
        try:
            record = json.loads((out_dir / RECORD).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("%s cannot be read (%s); the best is the checkpoint's", out_dir / RECORD, exc)
            return None
        fields = isinstance(record, dict) and {"monitor", "value", "step"} <= set(record)
        if not fields or not isinstance(record["value"], float | int) or not isinstance(record["step"], int):
            log.warning("%s is not a best.json; the best is the checkpoint's", out_dir / RECORD)
            return None
        return record if (out_dir / WEIGHTS).is_file() else None


def _copy(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)
