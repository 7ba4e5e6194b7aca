"""The limits this process's cgroup puts on it, read from /proc and /sys without torch (the doctor reads them too).

/proc/self/cgroup names the process's group per hierarchy: "0::/path" for cgroup v2, "N:cpu,cpuacct:/path"
for a v1 controller. The group's files lie under the hierarchy's mount at that path, and a parent's limit
binds its children too, so a limit is the smallest of the group's and of every group above it (Linux
kernel docs, admin-guide/cgroup-v2.rst and cgroup-v1/). A container mounts its own group at the mount's
root, which the walk up reaches last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Hierarchy = Literal["v1", "v2"]


def group_folders(controller: str, root: Path = Path("/")) -> list[tuple[Hierarchy, Path]]:
    """Return the folders of this process's group for ``controller`` and of every group above it, innermost first.

    ``root`` stands for / in tests. None is found where there is no /proc (macOS, Windows).
    """
    try:
        lines = (root / "proc/self/cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    found: list[tuple[Hierarchy, Path]] = []
    for line in lines:
        _, controllers, group = line.split(":", 2) if line.count(":") >= 2 else ("", "-", "")
        hierarchy: Hierarchy
        if controllers == "":
            hierarchy, mount = "v2", root / "sys/fs/cgroup"
        elif controller in controllers.split(","):
            hierarchy, mount = "v1", root / "sys/fs/cgroup" / controller
        else:
            continue
        folder = mount / group.strip("/")
        while True:
            found.append((hierarchy, folder))
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
    return found


def memory_limit_bytes(root: Path = Path("/")) -> int | None:
    """The memory limit of this process's cgroup or of one above it (a container's ``--memory``, a Slurm job's
    ``--mem``), or None when none is set: the kernel kills the process past it, however much the machine has.

    cgroup v2 keeps it in ``memory.max`` ("max" when unlimited), v1 in ``memory.limit_in_bytes`` (a value near
    2**63 when unlimited).
    """

    limits = []
    for hierarchy, folder in group_folders("memory", root):
        value = _integer(folder / ("memory.max" if hierarchy == "v2" else "memory.limit_in_bytes"))
        if value is not None and value < 2**60:  # v1 writes "unlimited" as the largest page-aligned int64
            limits.append(value)
    return min(limits) if limits else None


def memory_headroom_bytes(root: Path = Path("/")) -> int | None:
    """What this process's cgroup, or one above it, lets its processes take now: its limit less what the group
    holds, page cache the kernel reclaims first (inactive files) not counted as held, as ``docker stats`` and
    cAdvisor count a container's working set; None when no group has a limit.

    cgroup v2 keeps the usage in ``memory.current`` and ``inactive_file`` in ``memory.stat``, v1 in
    ``memory.usage_in_bytes`` and ``total_inactive_file``.
    """
    room = []
    for hierarchy, folder in group_folders("memory", root):
        v2 = hierarchy == "v2"
        limit = _integer(folder / ("memory.max" if v2 else "memory.limit_in_bytes"))
        used = _integer(folder / ("memory.current" if v2 else "memory.usage_in_bytes"))
        if limit is None or limit >= 2**60 or used is None:  # no limit here (v1's "unlimited" is near 2**63)
            continue
        cache = _stat(folder / "memory.stat", "inactive_file" if v2 else "total_inactive_file")
        room.append(max(limit - (used - min(cache, used)), 0))
    return min(room) if room else None


def cpu_limit_cores(root: Path = Path("/")) -> float | None:
    """The CPU limit of this process's cgroup or of one above it, in cores (``docker run --cpus 4``, a pod's
    CPU limit, systemd's CPUQuota=), or None when none is set.

    cgroup v2 keeps it in ``cpu.max`` as "quota period" ("max period" when unlimited), v1 in
    ``cpu.cfs_quota_us`` (-1 when unlimited) over ``cpu.cfs_period_us``, both in microseconds.
    """

    limits = []
    for hierarchy, folder in group_folders("cpu", root):
        if hierarchy == "v2":
            quota, _, period = _text(folder / "cpu.max").partition(" ")
        else:
            quota, period = _text(folder / "cpu.cfs_quota_us"), _text(folder / "cpu.cfs_period_us")
        try:
            cores = int(quota) / int(period)
        except (ValueError, ZeroDivisionError):  # no such group here, or "max"
            continue
        if cores > 0:
            limits.append(round(cores, 2))
    return min(limits) if limits else None


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, ValueError):  # no such file, or not text
        return ""


def _stat(path: Path, key: str) -> int:
    """A ``key value`` line of a cgroup's memory.stat, 0 where it is not there."""
    for line in _text(path).splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _integer(path: Path) -> int | None:
    try:
        return int(_text(path))
    except ValueError:
        return None
