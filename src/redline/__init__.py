"""redline: run plain PyTorch training and inference as fast as the hardware allows, and say why.

Importing redline initialises no CUDA context and imports no optional extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from redline.errors import ConfigError, DeviceUnavailableError, RedlineError, TaskSpecError
from redline.plan import Choice, Plan
from redline.runtime.options import RuntimeOptions
from redline.runtime.runtime import Runtime
from redline.task import Task, load_task
from redline.version import __version__

if TYPE_CHECKING:
    from redline.doctor.report import DoctorReport
    from redline.train.callbacks import Callback, EarlyStopping
    from redline.train.config import TrainerConfig
    from redline.train.summary import TrainSummary
    from redline.train.trainer import Trainer

# The Trainer and its companions load on first use: they bring logging and progress modules.
_LAZY = {
    "Trainer": "redline.train.trainer",
    "TrainerConfig": "redline.train.config",
    "TrainSummary": "redline.train.summary",
    "Callback": "redline.train.callbacks",
    "EarlyStopping": "redline.train.callbacks",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'redline' has no attribute {name!r}")


def doctor(*, quick: bool = False, probe_file: str | Path | None = None) -> DoctorReport:
    """Check this machine for GPU deep learning (or judge a saved snapshot); see `redline doctor`.

    Imported on first call, so `import redline` stays cheap; ``quick`` skips the measurements.
    """
    from redline.doctor import doctor as run_doctor

    return run_doctor(quick=quick, probe_file=probe_file)


__all__ = [
    "Callback",
    "Choice",
    "ConfigError",
    "DeviceUnavailableError",
    "EarlyStopping",
    "Plan",
    "RedlineError",
    "Runtime",
    "RuntimeOptions",
    "Task",
    "TaskSpecError",
    "TrainSummary",
    "Trainer",
    "TrainerConfig",
    "__version__",
    "doctor",
    "load_task",
]
