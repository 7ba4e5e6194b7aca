"""`redline doctor`: check a machine for GPU deep learning, measure its devices, and say how to fix it.

Probing and judging are separate: ``take_snapshot`` gathers facts (never raising, never starting
CUDA in this process), ``judge`` turns a snapshot into a ``DoctorReport`` with pure checks. A
snapshot saved on one machine is judged on another with ``load_snapshot``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

from redline.doctor.judge import judge
from redline.doctor.probes import take_snapshot
from redline.doctor.report import Check, DeviceReport, DoctorReport
from redline.doctor.snapshot import Snapshot, load_snapshot

__all__ = [
    "Check",
    "DeviceReport",
    "DoctorReport",
    "Snapshot",
    "doctor",
    "judge",
    "load_snapshot",
    "take_snapshot",
]


def doctor(*, quick: bool = False, probe_file: str | Path | None = None) -> DoctorReport:
    """Check this machine (or the snapshot in ``probe_file``) and return the report.

    ``quick`` skips the measurements. Takes a few seconds on a CPU-only machine; a hung driver call
    is cut off after ``child.DEFAULT_TIMEOUT_S`` and reported as a failed check.
    """
    snapshot = load_snapshot(probe_file) if probe_file is not None else take_snapshot(quick=quick)
    return judge(snapshot)


class _CallableModule(types.ModuleType):
    """Let ``redline.doctor(...)`` work after this subpackage replaced the function of that name.

    Importing ``redline.doctor`` binds the attribute ``redline.doctor`` to this module, hiding the
    lazy ``redline.doctor()`` function defined in redline/__init__.py; calling the module runs it.
    """

    def __call__(self, *, quick: bool = False, probe_file: str | Path | None = None) -> DoctorReport:
        return doctor(quick=quick, probe_file=probe_file)


sys.modules[__name__].__class__ = _CallableModule
