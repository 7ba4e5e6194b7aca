"""CUDA memory snapshots: what held the memory when a run ran out of it, for https://pytorch.org/memory_viz.

A snapshot always holds the caching allocator's segments and blocks; with the allocation history
recorded from the start of the run (``record_memory_history``, the Trainer's ``--memory-history``)
every block also carries the Python and C++ stack that allocated it, and the trace of allocations
and frees leading up to the failure (https://pytorch.org/docs/stable/torch_cuda_memory.html).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from redline.errors import describe_error

log = logging.getLogger("redline")

VIEWER = "https://pytorch.org/memory_viz"
HISTORY_ENTRIES = 100_000  # a few KB each: a snapshot of some hundred MB at most (torch.cuda.memory._dump_snapshot)


def write_memory_snapshot(device: torch.device, directory: Path | None, name: str) -> Path | None:
    """On CUDA, write the allocator's snapshot as ``directory/name.pickle`` and say where; None elsewhere.

    Never raises: a snapshot that cannot be written is a warning, not a second failure.
    """
    if device.type != "cuda" or directory is None or not torch.cuda.is_available():
        return None
    path = Path(directory) / f"{name}.pickle"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
    except Exception as exc:  # a diagnostic must not hide the out-of-memory it reports
        log.warning("could not write the memory snapshot %s: %s", path, describe_error(exc))
        return None
    log.warning("memory snapshot written to %s: open it at %s to see what held the memory", path, VIEWER)
    return path


@contextlib.contextmanager
def record_memory_history(device: torch.device) -> Iterator[None]:
    """On CUDA, record every allocation's stack while inside, so a snapshot shows who allocated what."""
    if device.type != "cuda" or not torch.cuda.is_available():
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
