"""Resuming a run: the options it continues under, and the results of one that had already ended."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from redline import checkpoint
from redline.checkpoint import Checkpoint
from redline.errors import DeviceUnavailableError
from redline.hardware.device import probe_accelerators
from redline.parallel.collectives import gather_objects
from redline.parallel.env import DistEnv
from redline.plan.device import resolve_device
from redline.runtime.options import RuntimeOptions
from redline.train.output import read_summary
from redline.train.summary import TrainSummary

log = logging.getLogger("redline")


def resumed_options(options: RuntimeOptions, found: Checkpoint | None, env: DistEnv) -> RuntimeOptions:
    """This run's Runtime options: a resumed run reuses the Plan it was written under."""
    if found is None:
        return options
    resumed = options.with_plan(checkpoint.load_plan(found))
    if env.distributed:  # the process group is already on this run's device: keep it
        resumed = dataclasses.replace(resumed, devices=options.devices)
    return _available_device(resumed)


def stored_summary(out_dir: Path, env: DistEnv) -> TrainSummary | None:
    """Rank 0's summary.json of a run that had ended, on every rank; None when it cannot be read.

    Without it (a run killed before writing it) the run goes on: its loop has nothing left to do
    and it writes the summary.
    """
    stored = read_summary(out_dir / "summary.json") if env.is_main else None
    stored = gather_objects(stored)[0]  # rank 0's: other machines may not see its out_dir
    try:
        return TrainSummary.from_dict(stored) if stored is not None else None
    except (TypeError, KeyError) as exc:
        log.warning("%s does not hold a run summary (%s); it will be written again", out_dir / "summary.json", exc)
        return None


def _available_device(options: RuntimeOptions) -> RuntimeOptions:
    """Keep a checkpoint's device where this machine has it (the device resolver decides), else use "auto"."""
    try:
        resolve_device(options.devices, probe_accelerators())
    except DeviceUnavailableError:
        return dataclasses.replace(options, devices="auto")
    return options
