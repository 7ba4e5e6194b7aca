"""How much of this process's CPUs other work took while it timed something, read from /proc without torch.

A trial on a CPU (runtime/measure.py) times fp32 against bf16 by their fastest steps, which a neighbour's load
cannot make faster; but it does not slow all forms alike. On a 2-core Xeon with AMX and three other processes
running, chargpt's bf16 step timed 0.18x fp32's, where on the quiet machine bf16 with math attention ran 1.3x: a
step whose threads wait for each other loses most when one of them is descheduled. Such a verdict, cached, would
decide every later run. ``Sampler`` tells how many of the process's CPUs other processes kept busy over an
interval (the kernel's own counts: /proc/stat per CPU, steal time included, less /proc/self/stat's), so the
measurement can say so and a later run can measure again. ``Stalls`` tells the same of a measurement too short
for those counts (milliseconds), from the time tasks waited for a CPU.

Linux only: elsewhere, or where /proc cannot be read, nothing is known and nothing is said.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from redline.errors import invalid

ENV = "REDLINE_CONTENTION"  # "off": a measurement is taken as quiet whatever the machine's load (tests pin it so)


def contention_off() -> bool:
    """Whether ``ENV`` turns the CPU-load reading off ("off"; unset or "on" reads it); another value is refused."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("", "on", "off"):
        raise invalid(ENV, os.environ[ENV], "off or on (unset: on)", "off takes every measurement as quiet")
    return value == "off"


# Under this many seconds the kernel's counts (in ticks of 10 ms) are too coarse to tell a neighbour from rounding.
LEAST_SECONDS = 0.5
# A measurement counts as contended where other work left this process fewer free CPUs than this share of the
# threads it runs: a neighbour on a CPU the process does not use takes nothing from it.
ROOM = 0.8
# A measurement too short for ``Sampler`` counts as taken on a busy machine where some task waited for a CPU this share
# of it (``Stalls``): two threads on two free CPUs wait for none, and beside a busy loop on one they wait half the time.
STALLED = 0.2


def stalled(share: float | None) -> bool:
    """Whether a measurement whose tasks waited for a CPU ``share`` of its time (``Stalls``) was taken on a busy
    machine; one not known (None) is taken as quiet."""
    return share is not None and share >= STALLED


@dataclass(frozen=True)
class CpuTimes:
    """The kernel's counts at one moment: ticks the process's CPUs spent busy (every process's), the process's own."""

    busy: int
    own: int
    at: float  # time.monotonic()


@dataclass(frozen=True)
class Contention:
    """Over an interval: the CPUs (in cores) other work kept busy, of ``cpus`` this process may run on, while it ran
    ``threads`` threads."""

    others: float
    cpus: int
    threads: int

    @property
    def contended(self) -> bool:
        """Whether other work left fewer free CPUs than the process's threads need (``ROOM``)."""
        return self.cpus - self.others < ROOM * min(self.threads, self.cpus)

    def __str__(self) -> str:
        return f"other processes kept {self.others:.1f} of the {self.cpus} CPU(s) it may run on busy"


class Sampler:
    """Reads the counts before and after: ``Sampler().start()``, then ``.stop(threads)`` gives the ``Contention``
    over the interval, or None where it cannot be known (no /proc, an interval too short, ``ENV`` off).

    ``root`` stands for / in tests, ``clock`` for time.monotonic, ``cpus`` for the CPUs the process may run on.
    """

    def __init__(
        self, root: Path = Path("/"), clock: Callable[[], float] = time.monotonic, cpus: set[int] | None = None
    ) -> None:
        self.root, self.clock = root, clock
        self.cpus = _affinity() if cpus is None else cpus
        self.before: CpuTimes | None = None

    def start(self) -> Sampler:
        self.before = self.read()
        return self

    def stop(self, threads: int) -> Contention | None:
        after = self.read()
        before = self.before
        if before is None or after is None or after.at - before.at < LEAST_SECONDS:
            return None
        ticks = (after.at - before.at) * _ticks_per_second()
        others = max(0, (after.busy - before.busy) - (after.own - before.own)) / ticks
        return Contention(others=min(others, len(self.cpus)), cpus=len(self.cpus), threads=max(1, threads))

    def read(self) -> CpuTimes | None:
        """The counts now; None where they cannot be read (or the check is off)."""
        if contention_off():
            return None
        try:
            stat = (self.root / "proc/stat").read_text(encoding="utf-8")
            busy = sum(_busy(line) for line in stat.splitlines() if _cpu_of(line) in self.cpus)
            return CpuTimes(busy=busy, own=self._own_ticks(), at=self.clock())
        except (OSError, ValueError, IndexError):
            return None

    def _own_ticks(self) -> int:
        """The ticks this process and its descendants ran: its own, its waited-for children's (cutime, cstime), and
        those of every live descendant (a bench's row processes, torch.compile's compile workers)."""
        pid, _, own = _process((self.root / "proc/self/stat").read_text(encoding="utf-8"))
        processes: dict[int, tuple[int, int]] = {}  # pid -> (its parent's pid, its ticks)
        for entry in self.root.glob("proc/[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):  # one that ended meanwhile, or unreadable
                other, parent, ticks = _process(entry.read_text(encoding="utf-8"))
                processes[other] = (parent, ticks)
        processes.pop(pid, None)
        ticks, frontier = own, {pid}
        while frontier:  # a generation of descendants at a time
            frontier = {other for other, (parent, _) in processes.items() if parent in frontier}
            ticks += sum(processes.pop(other)[1] for other in frontier)
        return ticks


class Stalls:
    """The share of the time measured in which tasks waited for a CPU, from Linux's pressure stall information: the
    "some" total (microseconds, brought up to date as it is read) of this process's cgroup (cgroup v2: its own
    tasks' waits, which a neighbour slows only where it runs on our CPUs), else of the machine (/proc/pressure/cpu).
    Unlike ``Sampler`` it tells a busy machine over a measurement of milliseconds. Our own threads count among the
    tasks: two threads on two free CPUs wait for none, and beside another process's busy loop on one of them they
    wait half the time. ``Stalls().start()`` then ``.stop()`` measures one interval; ``with stalls.counting():``
    adds each interval it is entered for (timed rounds, not the compiles between them) and ``.share()`` gives the
    share over them. None where it cannot be read (no PSI, not Linux, ``ENV`` off).

    ``root`` stands for / in tests, ``clock`` for time.monotonic.
    """

    def __init__(self, root: Path = Path("/"), clock: Callable[[], float] = time.monotonic) -> None:
        self.root, self.clock = root, clock
        self.file = _pressure_file(root)
        self.before: tuple[float, int] | None = None
        self.waited_us, self.seconds, self.known = 0, 0.0, True

    def start(self) -> Stalls:
        self.before = self.read()
        return self

    def stop(self) -> float | None:
        self._add(self.before, self.read())
        return self.share()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        before = self.read()
        try:
            yield
        finally:
            self._add(before, self.read())

    def share(self) -> float | None:
        """The share of the intervals counted in which some task waited, or None where it was not known."""
        if not self.known or self.seconds <= 0:
            return None
        return min(1.0, self.waited_us / (self.seconds * 1e6))

    def _add(self, before: tuple[float, int] | None, after: tuple[float, int] | None) -> None:
        if before is None or after is None or after[0] < before[0]:
            self.known = False
            return
        self.waited_us += max(0, after[1] - before[1])
        self.seconds += after[0] - before[0]

    def read(self) -> tuple[float, int] | None:
        """(now on ``clock``, the microseconds some task has waited for a CPU), or None."""
        if contention_off():
            return None
        try:
            text = self.file.read_text(encoding="utf-8")
            some = next(line for line in text.splitlines() if line.startswith("some "))
            return self.clock(), int(some.rsplit("total=", 1)[1])
        except (OSError, ValueError, IndexError, StopIteration):
            return None


def _pressure_file(root: Path) -> Path:
    """This process's cgroup v2 CPU pressure file where it has one (a container's, a systemd unit's; mounted at
    /sys/fs/cgroup or, on a hybrid system, /sys/fs/cgroup/unified), else the machine's."""
    with contextlib.suppress(OSError, ValueError):
        lines = (root / "proc/self/cgroup").read_text(encoding="utf-8").splitlines()
        group = next((line[3:].lstrip("/") for line in lines if line.startswith("0::")), None)
        for mount in ("sys/fs/cgroup", "sys/fs/cgroup/unified"):
            found = root / mount / group / "cpu.pressure" if group is not None else None
            if found is not None and found.is_file():
                return found
    return root / "proc/pressure/cpu"


def _process(stat: str) -> tuple[int, int, int]:
    """A /proc/PID/stat line's pid, parent pid, and ticks run: utime, stime, cutime and cstime (fields 14-17)."""
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": the state is field 3, the parent field 4
    return int(stat.split(maxsplit=1)[0]), int(fields[1]), sum(int(v) for v in fields[11:15])


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def _cpu_of(line: str) -> int | None:
    """The CPU a /proc/stat line counts ("cpu3 ..." is 3); None for the total line and the others."""
    name = line.split(maxsplit=1)[0] if line else ""
    return int(name[3:]) if name.startswith("cpu") and name[3:].isdigit() else None


def _busy(line: str) -> int:
    """A CPU's busy ticks: user, nice, system, irq, softirq and steal (another guest's turn on a VM's CPU)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in line.split()[1:9])
    return user + nice + system + irq + softirq + steal


def _ticks_per_second() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100
