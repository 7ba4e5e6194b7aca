"""redline: run plain PyTorch training and inference as fast as the hardware allows, and say why.

Importing redline imports no torch, initialises no CUDA context and imports no optional extra:
each public name loads its module on first use. So `redline doctor` runs, and says why, on a
machine where `import torch` itself fails.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from redline.version import __version__

if TYPE_CHECKING:
    from redline import doctor
    from redline.bench.profiling import Profile, profile
    from redline.bench.result import BenchResult
    from redline.bench.run import BenchInterrupted, benchmark
    from redline.bench.tune import tune
    from redline.bench.tune_cache import TuneInterrupted
    from redline.checkpoint.layout import CheckpointError
    from redline.errors import (
        ConfigError,
        DeviceUnavailableError,
        InferenceError,
        OutOfMemory,
        RedlineError,
        ServableError,
        StoppedBySignal,
        TaskError,
        TaskSpecError,
        TrainingError,
    )
    from redline.launch.torchrun import LaunchError
    from redline.memory.estimate import MemoryEstimate, estimate_memory
    from redline.memory.search import BatchSearch, find_batch_size
    from redline.parallel.collectives import RankZeroError
    from redline.parallel.watchdog import HangError
    from redline.plan import Choice, Plan
    from redline.render.html import report
    from redline.runtime.options import RuntimeOptions
    from redline.runtime.runtime import Runtime
    from redline.runtime.tuned import TunedPlan
    from redline.serve.app import build_app
    from redline.serve.engine import InferenceEngine
    from redline.serve.loadtest import run_load
    from redline.serve.options import ServeOptions
    from redline.serve.servable import Servable, load_servable
    from redline.task import Task, load_task
    from redline.train.callbacks import Callback, EarlyStopping
    from redline.train.config import TrainerConfig
    from redline.train.signals import ResultsSkipped
    from redline.train.summary import TrainSummary
    from redline.train.trainer import Trainer

# Public name -> the module that defines it; a subpackage (doctor) maps to itself.
_LAZY = {
    "BatchSearch": "redline.memory.search",
    "BenchInterrupted": "redline.bench.run",
    "BenchResult": "redline.bench.result",
    "Callback": "redline.train.callbacks",
    "CheckpointError": "redline.checkpoint.layout",
    "Choice": "redline.plan",
    "ConfigError": "redline.errors",
    "DeviceUnavailableError": "redline.errors",
    "EarlyStopping": "redline.train.callbacks",
    "HangError": "redline.parallel.watchdog",
    "InferenceEngine": "redline.serve.engine",
    "InferenceError": "redline.errors",
    "LaunchError": "redline.launch.torchrun",
    "MemoryEstimate": "redline.memory.estimate",
    "OutOfMemory": "redline.errors",
    "Plan": "redline.plan",
    "Profile": "redline.bench.profiling",
    "RankZeroError": "redline.parallel.collectives",
    "RedlineError": "redline.errors",
    "ResultsSkipped": "redline.train.signals",
    "Runtime": "redline.runtime.runtime",
    "Servable": "redline.serve.servable",
    "ServableError": "redline.errors",
    "ServeOptions": "redline.serve.options",
    "StoppedBySignal": "redline.errors",
    "RuntimeOptions": "redline.runtime.options",
    "Task": "redline.task",
    "TaskError": "redline.errors",
    "TaskSpecError": "redline.errors",
    "TrainingError": "redline.errors",
    "TrainSummary": "redline.train.summary",
    "Trainer": "redline.train.trainer",
    "TrainerConfig": "redline.train.config",
    "TuneInterrupted": "redline.bench.tune_cache",
    "TunedPlan": "redline.runtime.tuned",
    "benchmark": "redline.bench.run",
    "build_app": "redline.serve.app",
    "doctor": "redline.doctor",
    "estimate_memory": "redline.memory.estimate",
    "find_batch_size": "redline.memory.search",
    "load_servable": "redline.serve.servable",
    "load_task": "redline.task",
    "profile": "redline.bench.profiling",
    "report": "redline.render.html",
    "run_load": "redline.serve.loadtest",
    "tune": "redline.bench.tune",
}


if not TYPE_CHECKING:  # a type checker reads the names imported above: `redline.Trainr` is its error, not `object`

    def __getattr__(name: str) -> object:
        module_name = _LAZY.get(name)
        if module_name is None:
            raise AttributeError(f"module 'redline' has no attribute {name!r}")
        module = importlib.import_module(module_name)
        value = module if module_name == f"redline.{name}" else getattr(module, name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BatchSearch",
    "BenchInterrupted",
    "BenchResult",
    "Callback",
    "CheckpointError",
    "Choice",
    "ConfigError",
    "DeviceUnavailableError",
    "EarlyStopping",
    "HangError",
    "InferenceEngine",
    "InferenceError",
    "LaunchError",
    "MemoryEstimate",
    "OutOfMemory",
    "Plan",
    "Profile",
    "RankZeroError",
    "RedlineError",
    "ResultsSkipped",
    "Runtime",
    "RuntimeOptions",
    "Servable",
    "ServableError",
    "ServeOptions",
    "StoppedBySignal",
    "Task",
    "TaskError",
    "TaskSpecError",
    "TrainSummary",
    "Trainer",
    "TrainerConfig",
    "TrainingError",
    "TuneInterrupted",
    "TunedPlan",
    "__version__",
    "benchmark",
    "build_app",
    "doctor",
    "estimate_memory",
    "find_batch_size",
    "load_servable",
    "load_task",
    "profile",
    "report",
    "run_load",
    "tune",
]
