"""NCCL's switches are judged by the traffic they turn off: P2P and shared memory between this machine's GPUs,
InfiniBand between machines, which the doctor, seeing one machine, judges by the RDMA devices it has."""

from pathlib import Path

import pytest

from redline.doctor import judge, load_snapshot
from redline.doctor.probes import probe_infiniband
from redline.doctor.snapshot import Snapshot

FIXTURES = Path(__file__).parent.parent / "fixtures" / "doctor"


@pytest.mark.parametrize(
    ("infiniband", "status", "words"),
    [
        (None, "ok", "NCCL_IB_DISABLE set, which slows only collectives between nodes"),  # not looked for
        ([], "ok", "NCCL_IB_DISABLE set, which changes nothing: this machine has no InfiniBand or RoCE device"),
        (["mlx5_0", "mlx5_1"], "warn", "instead of this machine's InfiniBand/RoCE devices (mlx5_0, mlx5_1)"),
    ],
)
def test_infiniband_disabled_on_the_8xh100_server_warns_only_where_it_has_infiniband(infiniband, status, words):
    """It warned 'which slows every collective' on any machine: InfiniBand carries only traffic between nodes."""
    snap = load_snapshot(FIXTURES / "healthy-h100x8.json")
    snap.env["NCCL_IB_DISABLE"] = "1"
    snap.infiniband = infiniband
    check = judge(snap).check("nccl")
    assert check.status == status and words in check.detail, check
    if status == "warn":
        assert check.fix == "unset NCCL_IB_DISABLE before a run across nodes"
        assert "a run across nodes slows, one on this machine alone does not" in check.detail


def test_p2p_and_shared_memory_disabled_on_one_gpu_change_nothing():
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    snap.env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    check = judge(snap).check("nccl")
    assert check.status == "ok", check
    assert check.detail.endswith("; NCCL_P2P_DISABLE and NCCL_SHM_DISABLE set, which change nothing with one GPU")
    snap = load_snapshot(FIXTURES / "healthy-h100x8.json")  # eight GPUs: their traffic goes through the host
    snap.env["NCCL_P2P_DISABLE"] = "1"
    assert judge(snap).check("nccl").status == "warn"


def test_the_rdma_devices_are_listed_from_sysfs_and_kept_in_the_snapshot(tmp_path):
    for name in ("mlx5_1", "mlx5_0"):
        (tmp_path / name).mkdir()
    assert probe_infiniband(tmp_path) == ["mlx5_0", "mlx5_1"]
    assert probe_infiniband(tmp_path / "absent") == []
    snap = load_snapshot(FIXTURES / "healthy-h100x8.json")
    assert snap.infiniband is None  # taken before the doctor looked
    snap.infiniband = ["mlx5_0"]
    assert Snapshot.from_dict(snap.to_dict()).infiniband == ["mlx5_0"]
