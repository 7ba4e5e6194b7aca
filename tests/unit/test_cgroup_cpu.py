"""The cores a container or a job may use: its cgroup's CPU limit, read from a /proc and /sys given as files."""

from __future__ import annotations

from pathlib import Path

from test_cgroup_memory import machine  # the same /proc and /sys, written as files

from redline.hardware.cgroup import cpu_limit_cores


def test_a_v2_container_s_limit_is_read_at_its_namespace_s_root(tmp_path: Path) -> None:
    root = machine(tmp_path, "0::/\n", {"sys/fs/cgroup/cpu.max": "400000 100000"})  # docker run --cpus 4
    assert cpu_limit_cores(root) == 4.0


def test_a_v2_limit_on_a_group_below_the_root_binds_the_process(tmp_path: Path) -> None:
    # systemd-run -p CPUQuota=250% (or a pod seen without its own cgroup namespace): nothing at the root
    files = {
        "sys/fs/cgroup/system.slice/train.service/cpu.max": "250000 100000",
        "sys/fs/cgroup/system.slice/cpu.max": "max 100000",
    }
    root = machine(tmp_path, "0::/system.slice/train.service\n", files)
    assert cpu_limit_cores(root) == 2.5


def test_the_tightest_limit_of_the_groups_above_wins(tmp_path: Path) -> None:
    files = {
        "sys/fs/cgroup/kubepods.slice/pod1/cpu.max": "800000 100000",
        "sys/fs/cgroup/kubepods.slice/pod1/ctr/cpu.max": "max 100000",
        "sys/fs/cgroup/kubepods.slice/cpu.max": "150000 100000",
    }
    root = machine(tmp_path, "0::/kubepods.slice/pod1/ctr\n", files)
    assert cpu_limit_cores(root) == 1.5


def test_a_v1_limit_is_read_where_the_container_mounts_its_group(tmp_path: Path) -> None:
    cgroup = "12:pids:/docker/abc\n3:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"
    files = {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "200000", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"}
    assert cpu_limit_cores(machine(tmp_path, cgroup, files)) == 2.0


def test_no_limit_is_none(tmp_path: Path) -> None:
    v1_files = {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"}
    assert cpu_limit_cores(machine(tmp_path / "v1", "3:cpu,cpuacct:/\n", v1_files)) is None
    v2_files = {"sys/fs/cgroup/user.slice/cpu.max": "max 100000"}
    assert cpu_limit_cores(machine(tmp_path / "v2", "0::/user.slice\n", v2_files)) is None
    assert cpu_limit_cores(tmp_path / "no-proc") is None  # macOS, Windows
