"""Task: the one description of a workload that every redline command understands.

A Task names the model, the loss, the data, the optimizer factory and the batch size. It is built in
Python, or loaded from a spec string: ``example:NAME`` (built in), ``pkg.module:factory`` or
``path/to/file.py:factory``, where ``factory(**options)`` returns a Task.
"""

from redline.task.definition import (
    CollateFn,
    OptimizerFactory,
    SchedulerFactory,
    Task,
    model_fingerprint,
    require_task,
)
from redline.task.spec import (
    EXAMPLES,
    FORMS,
    call_factory,
    check_options,
    find_factory,
    load_task,
    run_factory,
    task_origin,
)

__all__ = [
    "EXAMPLES",
    "FORMS",
    "CollateFn",
    "OptimizerFactory",
    "SchedulerFactory",
    "Task",
    "call_factory",
    "check_options",
    "find_factory",
    "load_task",
    "model_fingerprint",
    "require_task",
    "run_factory",
    "task_origin",
]
