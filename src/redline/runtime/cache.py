"""The cache of measured choices on disk: trials, matmul peaks, tunes, optimizer step timings, each under a kind's
folder of ``$REDLINE_CACHE_DIR`` (default ``~/.cache/redline``), keyed by what was timed and the machine that
timed it, so a second run here pays nothing and another machine measures its own."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from redline.atomic import make_parent, write_atomic
from redline.hardware.device import DeviceFacts
from redline.hardware.flops import matmul_peak

log = logging.getLogger("redline")

CACHE_ENV = "REDLINE_CACHE_DIR"  # where measured choices are kept (default ~/.cache/redline)


def cache_key(fingerprint: str, facts: DeviceFacts, *what: str, threads: bool = True) -> str:
    """A cache key: the model's fingerprint, everything about this machine that times it, and ``what`` was timed.

    ``threads=False`` leaves out this process's thread count, for an entry that processes with other
    counts must find (a tune, read by the one-thread workers torchrun starts).
    """
    parts = (
        fingerprint, facts.type, facts.name, str(facts.capability), facts.cpu_isa, str(facts.cpu_count),
        torch.__version__, *([str(torch.get_num_threads())] if threads else []), *what,
    )  # fmt: skip
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:24]


def cache_dir() -> Path:
    """Where measured choices are cached: ``$REDLINE_CACHE_DIR`` (a quoted ``~`` read as the home directory), else
    ``~/.cache/redline``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "redline").expanduser()


def read_cache(kind: str, key: str) -> tuple[list[Any], str] | None:
    """The entries cached under ``kind``/``key`` and when they were measured, or None when absent or unreadable."""
    try:
        data = json.loads((cache_dir() / kind / f"{key}.json").read_text(encoding="utf-8"))
        return list(data["measured"]), str(data["measured_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_cache(kind: str, key: str, entries: list[Any]) -> None:
    """Cache ``entries`` under ``kind``/``key``, atomically; one that cannot be written is skipped with a warning."""
    path = cache_dir() / kind / f"{key}.json"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = json.dumps({"measured_at": when, "measured": entries}, indent=2) + "\n"

    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")

    try:
        make_parent(path)
        write_atomic(path, write)
    except OSError as exc:
        blocked = isinstance(exc, NotADirectoryError) and exc.filename  # make_parent names the file in the way
        cause = Path(exc.filename) if blocked else cache_dir()  # a read-only cache fails in each kind's folder
        if cause in _UNWRITABLE:  # said once: a run measures a stalled peak again, and caches its trial beside it
            return
        _UNWRITABLE.add(cause)
        if blocked:
            log.warning(
                "could not cache the measurement in %s: %s is a file, where the cache's directory goes; the next run "
                "measures again\nhint: move it, or point %s at a directory", path, exc.filename, CACHE_ENV,
            )  # fmt: skip
        else:
            log.warning("could not cache the measurement in %s (%s); the next run measures again", path, exc)


_UNWRITABLE: set[Path] = set()  # the caches a write failed in (or the file in their way), in this process


def best_matmul_peak(device: torch.device, facts: DeviceFacts, precision: str, *, blocks: int = 5) -> float | None:
    """The matmul TFLOP/s ``device`` does in ``precision``: the best of a measurement now and those cached before on
    this machine (its threads and torch included). A measurement only ever comes out low (a busy machine's stall:
    a 2-core CPU timed 0.004 TFLOP/s beside another job, 0.27 alone), so the best one seen is the device's peak;
    a new best is cached. None where none was ever measured (a GPU the run left full)."""
    key = cache_key("matmul peak", facts, precision, torch.get_float32_matmul_precision())  # TF32's on or off
    found = read_cache("peaks", key)
    peaks = [float(v) for v in found[0] if isinstance(v, int | float) and not isinstance(v, bool)] if found else []
    before = max((v for v in peaks if math.isfinite(v) and v > 0), default=None)  # an edited 0 or inf: none
    now = matmul_peak(device, precision, blocks=blocks)
    if now is not None and (before is None or now > before):
        write_cache("peaks", key, [now])
    return max((v for v in (now, before) if v is not None), default=None)
