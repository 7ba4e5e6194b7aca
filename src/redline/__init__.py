"""redline: run plain PyTorch training and inference as fast as the hardware allows, and say why.

Importing redline initialises no CUDA context and imports no optional extra.
"""

from redline.errors import ConfigError, DeviceUnavailableError, RedlineError, TaskSpecError
from redline.plan import Choice, Plan
from redline.runtime.runtime import Runtime
from redline.task import Task, load_task

__version__ = "0.1.0"

__all__ = [
    "Choice",
    "ConfigError",
    "DeviceUnavailableError",
    "Plan",
    "RedlineError",
    "Runtime",
    "Task",
    "TaskSpecError",
    "__version__",
    "load_task",
]
