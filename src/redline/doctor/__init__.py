"""`redline doctor`: check a machine for GPU deep learning, measure its devices, and say how to fix it.

``check_machine()`` is what the command runs. Probing and judging are separate: ``take_snapshot``
gathers facts (never raising, never importing torch or starting CUDA in this process), ``judge``
turns a snapshot into a ``DoctorReport`` with pure checks. A snapshot saved on one machine is
judged on another with ``load_snapshot``. Nothing here imports torch, so the doctor runs where
`import torch` fails and reports why.
"""

from __future__ import annotations

import os
from pathlib import Path

from redline.config import boolean
from redline.doctor.judge import judge
from redline.doctor.probes import take_snapshot
from redline.doctor.report import Check, DeviceReport, DoctorReport
from redline.doctor.snapshot import Snapshot, load_snapshot
from redline.errors import invalid

__all__ = [
    "Check",
    "DeviceReport",
    "DoctorReport",
    "Snapshot",
    "check_machine",
    "judge",
    "load_snapshot",
    "take_snapshot",
]


def check_machine(*, quick: bool = False, probe_file: str | Path | None = None) -> DoctorReport:
    """Check this machine (or the snapshot in ``probe_file``) and return the report.

    ``quick`` starts no child process: no measurements, and torch's build read from its files
    without importing it. A full run takes a few seconds on a CPU-only machine; a hung driver call
    is cut off after ``child.DEFAULT_TIMEOUT_S`` and reported as a failed check. ``quick`` with
    ``probe_file`` raises ConfigError, as `redline doctor --quick --probe-file` refuses them: a saved
    snapshot is judged as it was taken.
    """
    boolean("quick", quick)
    if probe_file is not None and not isinstance(probe_file, str | os.PathLike):
        raise invalid("probe_file", probe_file, "a path to a snapshot file, or None", "e.g. probe_file='probe.json'")
    if probe_file is not None and quick:
        raise invalid("quick", quick, "False with probe_file", "a saved snapshot is judged as it was taken; drop quick")
    snapshot = load_snapshot(probe_file, name="probe_file") if probe_file is not None else take_snapshot(quick=quick)
    return judge(snapshot)
