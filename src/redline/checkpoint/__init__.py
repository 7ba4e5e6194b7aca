"""Checkpoints that survive a crash at any moment: one directory layout, two formats.

``layout`` names, commits, lists and verifies checkpoint directories, ``finding`` picks the one a
run resumes from, and ``reading`` reads their files back; ``whole`` is the format one process
writes (one device, DDP), ``sharded`` the one every rank writes its shards of (FSDP); both refuse,
through ``shapes``, a checkpoint of another model before loading it. The Runtime picks the format
through its strategy (``Runtime.save`` / ``Runtime.load``).
"""

from redline.checkpoint.finding import open_checkpoint, open_verified
from redline.checkpoint.layout import (
    Checkpoint,
    CheckpointError,
    clean_staging,
    find_checkpoints,
    other_versions,
    prune,
    read_checkpoint,
    recover,
    step_dir,
    verify,
)
from redline.checkpoint.reading import load_plan

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "clean_staging",
    "find_checkpoints",
    "load_plan",
    "open_checkpoint",
    "open_verified",
    "other_versions",
    "prune",
    "read_checkpoint",
    "recover",
    "step_dir",
    "verify",
]
