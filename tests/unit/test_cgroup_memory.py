"""The memory a container or a job may use: its cgroup's limit, read from a /proc and /sys given as files."""

from __future__ import annotations

from pathlib import Path

from redline.hardware.cgroup import memory_headroom_bytes
from redline.hardware.memory import memory_limit_bytes

GIB = 2**30
V1_UNLIMITED = "9223372036854771712"


def machine(root: Path, cgroup: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text + "\n")
    return root


def test_a_v2_container_s_limit_is_read_at_its_namespace_s_root(tmp_path: Path) -> None:
    root = machine(tmp_path, "0::/\n", {"sys/fs/cgroup/memory.max": str(8 * GIB)})  # docker run --memory 8g
    assert memory_limit_bytes(root) == 8 * GIB


def test_a_v2_job_s_limit_binds_however_deep_its_group(tmp_path: Path) -> None:
    files = {
        "sys/fs/cgroup/system.slice/slurmstepd.scope/job_42/memory.max": str(16 * GIB),  # srun --mem 16G
        "sys/fs/cgroup/system.slice/slurmstepd.scope/job_42/step_0/memory.max": "max",
        "sys/fs/cgroup/system.slice/memory.max": "max",
    }
    root = machine(tmp_path, "0::/system.slice/slurmstepd.scope/job_42/step_0\n", files)
    assert memory_limit_bytes(root) == 16 * GIB


def test_a_v1_limit_is_read_where_the_container_mounts_its_group(tmp_path: Path) -> None:
    cgroup = "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n"
    root = machine(tmp_path, cgroup, {"sys/fs/cgroup/memory/memory.limit_in_bytes": str(4 * GIB)})
    assert memory_limit_bytes(root) == 4 * GIB


def test_no_limit_is_none(tmp_path: Path) -> None:
    v1 = machine(
        tmp_path / "v1", "4:memory:/user.slice\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED}
    )
    assert memory_limit_bytes(v1) is None
    v2 = machine(tmp_path / "v2", "0::/user.slice\n", {"sys/fs/cgroup/user.slice/memory.max": "max"})
    assert memory_limit_bytes(v2) is None
    assert memory_limit_bytes(tmp_path / "no-proc") is None  # macOS, Windows


def test_a_v2_group_s_headroom_is_its_limit_less_what_it_holds_its_reclaimable_cache_not_counted(
    tmp_path: Path,
) -> None:
    files = {
        "sys/fs/cgroup/memory.max": str(8 * GIB),
        "sys/fs/cgroup/memory.current": str(5 * GIB),  # 1 GiB of it inactive page cache, which the kernel drops first
        "sys/fs/cgroup/memory.stat": f"anon {3 * GIB}\nfile {2 * GIB}\ninactive_file {GIB}\nactive_file {GIB}",
    }
    assert memory_headroom_bytes(machine(tmp_path, "0::/\n", files)) == 4 * GIB


def test_a_v1_group_s_headroom_and_none_without_a_limit(tmp_path: Path) -> None:
    files = {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": str(4 * GIB),
        "sys/fs/cgroup/memory/memory.usage_in_bytes": str(3 * GIB),
        "sys/fs/cgroup/memory/memory.stat": f"cache {GIB}\ntotal_inactive_file {GIB // 2}",
    }
    assert memory_headroom_bytes(machine(tmp_path / "v1", "4:memory:/docker/abc\n", files)) == GIB + GIB // 2
    unlimited = {"sys/fs/cgroup/memory.max": "max", "sys/fs/cgroup/memory.current": str(GIB)}
    assert memory_headroom_bytes(machine(tmp_path / "v2", "0::/\n", unlimited)) is None
