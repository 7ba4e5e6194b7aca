"""On a CPU, the batch sizes the search does not run: those predicted to need more memory than the process has.

A CPU has no out-of-memory error to catch: past the memory the machine has free, or its cgroup's limit (a container's
``--memory``, a Slurm job's ``--mem``), the kernel kills the process, and the search with it. So each size is
weighed first against the peak resident memory of the sizes that ran (the process's high-water mark, read per
probe): the peak grows in a line with the batch, and a size whose line passes the budget is recorded as not
fitting instead of being run.
"""

from __future__ import annotations

import torch

from redline.hardware.cgroup import memory_headroom_bytes
from redline.hardware.memory import WindowPeak, machine_memory_bytes, memory_limit_bytes, proc_bytes, resident_bytes

GIB = 2**30
# The share of what the process can reach (or of the cgroup's limit) a probe may use: the allocator keeps
# freed pages a while, and other processes' memory moves while the search runs.
HOST_SHARE = 0.9
NOT_RUN = "was not run"
MEMINFO = "/proc/meminfo"


class HostGuard:
    """Weigh each size against this process's memory before it runs; learn the line from the sizes that ran."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = host_budget() if budget is None else budget
        self.peak = WindowPeak(torch.device("cpu"))
        self.points: list[tuple[int, int]] = []  # (size, its probe's peak), sizes growing

    def refuse(self, size: int) -> str:
        """Why ``size`` is not to run ("" to run it); a size to run starts the window its peak is read over."""
        need = predicted_peak(self.points, size)
        if need is not None and need > self.budget:
            digits = 2  # as many as tell the two apart: 1.77 GiB past 1.77 GiB reads as a contradiction
            while round(need / GIB, digits) <= round(self.budget / GIB, digits) and digits < 6:
                digits += 1
            return (
                f"{NOT_RUN}: predicted to need about {need / GIB:.{digits}f} GiB (from the peaks of the sizes that "
                f"ran), past the {self.budget / GIB:.{digits}f} GiB this machine gives the process, where the kernel "
                "would kill it"
            )
        self.peak.read()
        return ""

    def ran(self, size: int, fitted: bool) -> None:
        """Take the peak of the size that just ran; only a larger size than the last adds to the line (where the
        high-water mark cannot be reset, a smaller one reads the larger one's peak)."""
        peak = self.peak.read()
        if fitted and peak is not None and (not self.points or size > self.points[-1][0]):
            self.points.append((size, peak))


def predicted_peak(points: list[tuple[int, int]], size: int) -> int | None:
    """The peak of ``size`` on the line through the two largest sizes that ran (None below them, or before two
    ran); a line that falls (the allocator's noise at small sizes) is taken as flat."""
    if len(points) < 2 or size <= points[-1][0]:
        return None
    (s1, p1), (s2, p2) = points[-2:]
    slope = max((p2 - p1) / (s2 - s1), 0.0)
    return int(p2 + slope * (size - s2))


def host_budget() -> int:
    """The bytes a probe may reach, times the share: what this process holds and the memory the machine has free
    besides (other processes keep theirs), or its cgroup's limit where that is lower."""
    reachable = (resident_bytes() or 0) + _available_bytes()
    limit = memory_limit_bytes()
    return int(min(reachable, limit if limit is not None else reachable) * HOST_SHARE)


def _available_bytes() -> int:
    """The memory the machine has free for a process to take (MemAvailable, /proc/meminfo, man 5 proc); where
    that cannot be read (macOS, Windows), all of the machine's memory."""
    available = proc_bytes(MEMINFO, "MemAvailable")
    return available if available is not None else machine_memory_bytes()


def free_bytes() -> int:
    """The memory a new process could take now, beside this one and every other: what the machine has free
    (MemAvailable), or what its cgroup's limit leaves where that is less. ``redline memory`` weighs a CPU's step
    against it: the run will need an interpreter and torch as this process holds them, which it stands in for."""
    room = memory_headroom_bytes()
    return min(_available_bytes(), room) if room is not None else _available_bytes()
