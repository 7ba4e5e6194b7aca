"""Memory readings of this process and its device, for the Trainer's logs and the bench rows alike.

A CUDA device keeps its own peak counter (``torch.cuda.max_memory_allocated``), which
``reset_peak_memory_stats`` starts again. A CPU run's memory is the process's resident set; Linux
keeps its high-water mark (VmHWM in /proc/self/status) and starts it again at the current resident
set when "5" is written to /proc/self/clear_refs (``man 5 proc``). Elsewhere (macOS, Windows, a
kernel that refuses the write) only the all-time peak is known: ``getrusage``'s ru_maxrss.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Literal

import torch

# Kept here for its callers; it lives in hardware.cgroup, which the doctor reads without importing torch.
from redline.hardware.cgroup import memory_limit_bytes as memory_limit_bytes

STATM = "/proc/self/statm"
STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"
_RESET_PEAK_RSS = "5"  # clear_refs: "reset the peak resident set size ("high water mark") to the process's RSS"

PeakKind = Literal["allocated", "resident", "resident since start", "current"]


def resident_bytes() -> int | None:
    """The process's resident set in bytes, or None where /proc is not there (macOS, Windows)."""
    try:
        with open(STATM, encoding="ascii") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def machine_memory_bytes() -> int:
    """The machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_memory_bytes() -> int:
    """The memory this process may fill: the machine's, or its cgroup's limit where that is lower."""
    machine, limit = machine_memory_bytes(), memory_limit_bytes()
    return min(machine, limit) if limit is not None else machine


def resident_peak_bytes() -> int | None:
    """The process's resident high-water mark (VmHWM) in bytes since start or the last reset; None without /proc."""
    return proc_bytes(STATUS, "VmHWM")


def proc_bytes(path: str, key: str) -> int | None:
    """The ``key`` line of a /proc file that lists "Key:  N kB" (/proc/self/status, /proc/meminfo) in bytes, or
    None where the file or the line cannot be read (``man 5 proc``)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024  # the kernel writes it in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_resident_peak() -> bool:
    """Start the process's resident high-water mark again from its resident set now; return whether it could.

    The mark is the whole process's: every reader of VmHWM (and of ru_maxrss) in this process sees the reset.
    """
    try:
        with open(CLEAR_REFS, "w", encoding="ascii") as f:
            f.write(_RESET_PEAK_RSS)
    except OSError:
        return False
    return resident_peak_bytes() is not None


def max_resident_bytes() -> int:
    """The process's all-time peak resident set in bytes (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class WindowPeak:
    """The peak memory of each window of a run: ``read()`` returns the peak since the last read (or since built).

    What ``kind`` says it is:
      - "allocated" on CUDA: the caching allocator's peak of allocated bytes, its counter reset per window;
      - "resident" on a Linux CPU: the process's resident high-water mark, reset per window (clear_refs);
      - "resident since start" where that reset is refused: ru_maxrss, the all-time peak, never lower;
      - "current" on MPS: the Metal driver's allocated bytes at the read (torch keeps no MPS peak).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind: PeakKind
        if device.type == "cuda":
            self.kind = "allocated"
            torch.cuda.reset_peak_memory_stats(device)
        elif device.type == "mps":
            self.kind = "current"
        else:
            self.kind = "resident" if reset_resident_peak() else "resident since start"

    def read(self) -> int | None:
        """Return the window's peak in bytes and start the next window (None where nothing can be read)."""
        if self.kind == "allocated":
            peak = torch.cuda.max_memory_allocated(self.device)  # the allocator counts on the host: no sync
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        if self.kind == "current":
            return int(torch.mps.driver_allocated_memory())
        if self.kind == "resident":
            high = resident_peak_bytes()
            reset_resident_peak()
            return high
        return max_resident_bytes()
