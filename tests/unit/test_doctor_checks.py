"""The doctor's checks judge snapshots of broken and healthy machines: the right verdict and the right remedy."""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redline.doctor import DoctorReport, judge, load_snapshot
from redline.doctor.checks import BUG_REPORT_FIX, CHECKS, run_checks
from redline.doctor.checks.machine import Machine
from redline.doctor.checks.rocm import gfx_version
from redline.doctor.report import Check
from redline.doctor.snapshot import (
    AmdFacts,
    ChildRun,
    DriverFacts,
    GpuFacts,
    LibraryDir,
    Measurement,
    ShmFacts,
    Snapshot,
    SystemFacts,
    TorchDevice,
    TorchFacts,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "doctor"

# Each broken machine: every check that warns or fails, its status, and words its fix must contain.
BROKEN = {
    "cpu-wheel-on-gpu": {
        "torch-build": ("fail", ["pip install", "torch==2.13.0", "torchvision", "download.pytorch.org/whl/cu126"]),
        "cuda-available": ("fail", ["download.pytorch.org/whl/cu126"]),
    },
    "cpu-wheel-on-rtx5090-driver-570": {  # sm_120 needs cu128+: cu129 runs on driver 570 in minor-version compat
        "torch-build": ("fail", ["whl/cu129", "570.133.07) runs only in minor-version compatibility", "575.51.03"]),
        "cuda-available": ("fail", ["whl/cu129", "575.51.03"]),
    },
    "driver-too-old": {  # cu130 does not start on driver 550, cu126 does
        "driver-runtime-compat": ("fail", ["keep the driver", "whl/cu126", "upgrade the NVIDIA driver to 580.65.06"]),
        "cuda-available": ("fail", ["keep the driver", "whl/cu126", "upgrade the NVIDIA driver to 580.65.06"]),
    },
    "driver-minor-version-compat": {
        "driver-runtime-compat": ("warn", ["upgrade the NVIDIA driver to 570.26"]),
    },
    "sm120-gpu-old-wheel": {
        "gpu-arch-supported": ("fail", ["'torch>=2.7'", "torchvision", "whl/cu128"]),
        "device-smoke": ("fail", ["whl/cu128"]),
    },
    "old-gpu-new-wheel": {
        "gpu-arch-supported": ("fail", ["torch==2.9.1", "whl/cu126"]),
        "device-smoke": ("fail", ["whl/cu126"]),
    },
    "visible-devices-out-of-range": {
        "visible-devices": ("fail", ["unset CUDA_VISIBLE_DEVICES", "0,1,2,3"]),
        "cuda-available": ("fail", ["unset CUDA_VISIBLE_DEVICES"]),
    },
    "visible-devices-repeated": {
        "visible-devices": ("fail", ["export CUDA_VISIBLE_DEVICES=0,1"]),
        "cuda-available": ("fail", ["CUDA_VISIBLE_DEVICES"]),
    },
    "shm-64mb-docker": {
        "shm-size": ("fail", ["--ipc=host", "--shm-size"]),
    },
    "ld-library-path-import-error": {
        "torch-build": ("fail", ["export LD_LIBRARY_PATH=/opt/tools/lib"]),
        "library-shadowing": ("fail", ["export LD_LIBRARY_PATH=/opt/tools/lib"]),
    },
    "cudnn-missing-in-container": {
        "torch-build": (
            "fail",
            ["pip install --force-reinstall torch==2.4.0 --index-url https://download.pytorch.org/whl/cu124"],
        ),
    },
    "ld-library-path-older-cuda": {
        "library-shadowing": ("fail", ["export LD_LIBRARY_PATH=/opt/tools/lib"]),
    },
    "cudnn-shadowed": {
        "cudnn": ("fail", ["unset LD_LIBRARY_PATH"]),
        "library-shadowing": ("fail", ["unset LD_LIBRARY_PATH"]),
    },
    "torch-logs-refused": {
        "torch-build": ("fail", ["unset TORCH_LOGS", "TORCH_LOGS='dynamo,nonsense'"]),
    },
    "torchvision-mismatch": {
        "torch-companions": ("fail", ["--no-deps torchvision==0.19.*", "whl/cu121"]),
    },
    "driver-library-mismatch": {
        "nvidia-driver": ("fail", ["reboot", "modprobe nvidia"]),
        "cuda-available": ("fail", ["reboot"]),
    },
    "fabric-manager-802": {
        "cuda-available": ("fail", ["nvidia-fabricmanager", "550.90.07"]),
    },
    "cuda-init-hang": {
        "cuda-available": ("fail", ["nvidia-smi", "reboot"]),
        "device-smoke": ("fail", ["nvidia-smi"]),
    },
    "cpu-threads-oversubscribed": {
        "cpu-threads": ("warn", ["export OMP_NUM_THREADS=4"]),
    },
    "mac-rosetta-python": {
        "python": ("fail", ["native arm64 Python"]),
        "mps": ("fail", ["native arm64 Python"]),
    },
    "gpu-wrong-result": {
        "device-smoke": ("fail", ["nvidia-smi -q -d ECC", "xid"]),
    },
    "nccl-p2p-disabled": {
        "nccl": ("warn", ["unset NCCL_P2P_DISABLE"]),
    },
    "slow-pcie-link": {
        "h2d-bandwidth": ("warn", ["nvidia-smi -q -d PCI"]),
    },
    "rocm-kfd-permission": {
        "rocm-devices": ("fail", ["sudo usermod -aG render,video $USER"]),
        "cuda-available": ("fail", ["sudo usermod -aG render,video $USER"]),
    },
}
HEALTHY = ["healthy-cpu-laptop", "healthy-h100x8", "healthy-h200", "healthy-mac-m2", "healthy-mi300x8"]


def report_of(name: str) -> DoctorReport:
    return judge(load_snapshot(FIXTURES / f"{name}.json"))


def test_every_fixture_is_named_here():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted([*BROKEN, *HEALTHY])
    assert len(BROKEN) >= 12


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_machine_gets_the_right_verdicts_and_fixes(name):
    report = report_of(name)
    problems = {c.id: c for c in report.checks if c.status in ("warn", "fail")}
    assert set(problems) == set(BROKEN[name]), {c.id: (c.status, c.detail) for c in problems.values()}
    for check_id, (status, remedies) in BROKEN[name].items():
        check = problems[check_id]
        assert check.status == status, check
        for remedy in remedies:
            assert remedy in (check.fix or ""), f"{check_id}: {remedy!r} not in fix {check.fix!r}"
    assert report.exit_code == (1 if any(s == "fail" for s, _ in BROKEN[name].values()) else 0)


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_machine_passes_every_check(name):
    report = report_of(name)
    assert [c for c in report.checks if c.status not in ("ok", "skip")] == []
    assert report.exit_code == 0


def test_the_8xh100_server_is_judged_on_every_gpu_check():
    report = report_of("healthy-h100x8")
    gpu_checks = ["nvidia-driver", "torch-build", "cuda-available", "driver-runtime-compat", "gpu-arch-supported"]
    gpu_checks += ["visible-devices", "cudnn", "nccl", "library-shadowing", "torch-companions", "device-smoke"]
    gpu_checks += ["h2d-bandwidth"]
    assert {c.id: c.status for c in report.checks if c.id in gpu_checks} == dict.fromkeys(gpu_checks, "ok")
    assert "cuda:0-7" in report.check("device-smoke").detail
    assert [d.id for d in report.devices] == ["cpu", *(f"cuda:{i}" for i in range(8))]
    assert report.devices[1].lowp_tflops == 720.0 and report.devices[1].capability == "9.0"


@pytest.mark.parametrize(
    ("directory", "libs"),
    [
        # A system cuDNN of the wheel's own release: its file names three parts, the wheel's version four.
        ("/usr/lib/x86_64-linux-gnu", ["libcudnn.so.9", "libcudnn.so.9.7.1"]),
        # A toolkit folder with only the soname link: the version comes from the folder, major.minor.
        ("/usr/local/cuda-12.8/lib64", ["libnvJitLink.so.12"]),
    ],
)
def test_a_system_library_as_new_as_the_wheels_is_not_called_older(directory, libs):
    snap = load_snapshot(FIXTURES / "healthy-h100x8.json")
    snap.library_path = [LibraryDir(path=directory, libs=libs)]
    check = judge(snap).check("library-shadowing")
    assert check.status == "ok", check.detail
    snap.library_path = [LibraryDir(path="/usr/lib/x86_64-linux-gnu", libs=["libcudnn.so.9", "libcudnn.so.9.5.1"])]
    assert judge(snap).check("library-shadowing").status == "fail"  # an older one is still caught


def test_cuda_13_wheels_in_one_folder_are_compared_by_their_own_packages():
    # CUDA 13 wheels share site-packages/nvidia/cu13/lib; each library's version is its package's
    # (libcudart: nvidia-cuda-runtime 13.0.96, libnvJitLink: nvidia-nvjitlink 13.0.88 on the H200).
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    toolkit = "/usr/local/cuda-13.0/lib64"
    snap.library_path = [LibraryDir(path=toolkit, libs=["libcudart.so.13", "libcudart.so.13.0.96"])]
    check = judge(snap).check("library-shadowing")
    assert check.status == "ok", check.detail
    snap.library_path = [LibraryDir(path=toolkit, libs=["libnvJitLink.so.13", "libnvJitLink.so.13.0.39"])]
    check = judge(snap).check("library-shadowing")
    assert check.status == "fail" and "libnvJitLink.so.13 13.0.39 (wheel: 13.0.88)" in check.detail, check.detail


def test_the_cudnn_frontend_package_is_not_taken_for_the_cudnn_wheel():
    # nvidia-cudnn-frontend (1.x, a header library some packages pull in) is not cuDNN itself.
    snap = load_snapshot(FIXTURES / "healthy-h100x8.json")
    del snap.packages["nvidia-cudnn-cu12"]
    snap.packages["nvidia-cudnn-frontend"] = "1.14.0"
    check = judge(snap).check("cudnn")
    assert check.status == "ok", check.detail


def test_the_real_h200_snapshot_is_judged_healthy_on_every_check():
    # Taken by benchmarks/gpu/doctor.sh on an H200 (driver 580.159.04, torch 2.11.0+cu130), not written by hand.
    report = report_of("healthy-h200")
    statuses = {c.id: c.status for c in report.checks}
    assert statuses == {**dict.fromkeys(CHECKS, "ok"), "mps": "skip", "rocm-devices": "skip"}
    assert "NVIDIA H200 (sm_90) covered" in report.check("gpu-arch-supported").detail
    assert "bf16 703 TFLOP/s" in report.check("device-smoke").detail
    assert [(d.id, d.name, d.capability, d.lowp_tflops) for d in report.devices] == [
        ("cpu", "Intel(R) Xeon(R) Processor", None, None),
        ("cuda:0", "NVIDIA H200", "9.0", 703.0),
    ]
    assert report.versions["torch"] == "2.11.0+cu130" and report.versions["cudnn"] == "9.19.0"


def test_the_cpu_laptop_skips_gpu_checks_with_a_reason():
    report = report_of("healthy-cpu-laptop")
    for check_id in ("cuda-available", "driver-runtime-compat", "gpu-arch-supported", "cudnn", "nccl", "h2d-bandwidth"):
        check = report.check(check_id)
        assert check.status == "skip" and check.detail, check


def test_the_cpu_matmul_figure_reads_the_same_in_every_check_that_shows_it():
    snap = load_snapshot(FIXTURES / "healthy-cpu-laptop.json")
    slow = [replace(r, fp32_tflops=0.0135) if r.device == "cpu" else r for r in snap.measurements]
    report = judge(replace(snap, measurements=slow))
    assert "fp32 matmul 13.5 GFLOP/s" in report.check("cpu-threads").detail
    assert "fp32 13.5 GFLOP/s" in report.check("device-smoke").detail


@pytest.mark.parametrize("name", sorted([*BROKEN, *HEALTHY]))
def test_every_report_lists_each_check_once_and_judges_them_all(name):
    report = report_of(name)
    assert [c.id for c in report.checks] == list(CHECKS)
    assert all(c.fix for c in report.checks if c.status in ("warn", "fail"))
    assert not any("could not judge" in c.detail for c in report.checks)  # no check raised
    assert json.loads(json.dumps(report.to_dict()))["checks"][0] == {
        "id": "python",
        "status": report.checks[0].status,
        "detail": report.checks[0].detail,
        "fix": report.checks[0].fix,
    }


def test_gpus_torch_cannot_see_are_listed_as_unusable():
    report = report_of("driver-too-old")
    assert [(d.id, d.usable) for d in report.devices] == [("cpu", True)] + [(f"gpu:{i}", False) for i in range(4)]


def test_a_check_that_raises_becomes_a_failed_check():
    def broken(_machine):
        raise KeyError("capability")

    checks = run_checks(Snapshot(), {"python": CHECKS["python"], "broken": broken})
    assert checks[0].id == "python"
    assert checks[1] == Check(
        id="broken", status="fail", detail="redline could not judge this: KeyError: 'capability'", fix=BUG_REPORT_FIX
    )


@pytest.mark.parametrize(("probe", "check_id"), [("shm", "shm-size"), ("driver", "nvidia-driver")])
def test_a_probe_that_raised_is_said_in_its_check_not_judged_from_the_defaults_it_left(probe, check_id):
    snapshot = load_snapshot(FIXTURES / "healthy-h200.json")
    setattr(snapshot, probe, Snapshot().driver if probe == "driver" else None)  # what the failed probe leaves
    snapshot.probe_errors[probe] = "PermissionError: [Errno 13] Permission denied"
    check = {c.id: c for c in run_checks(snapshot)}[check_id]
    assert check.status == "warn" and check.fix == BUG_REPORT_FIX, check
    assert check.detail == f"not checked: probing it failed ({probe}: PermissionError: [Errno 13] Permission denied)"


def test_the_companions_that_match_torch_are_said_in_a_sentence():
    one = {c.id: c for c in report_of("cpu-wheel-on-gpu").checks}["torch-companions"]
    assert one.status == "ok" and one.detail == "torchvision 0.28.0+cpu matches torch 2.13.0+cpu"
    snapshot = load_snapshot(FIXTURES / "cpu-wheel-on-gpu.json")
    snapshot.packages["torchaudio"] = "2.13.0+cpu"
    two = {c.id: c for c in run_checks(snapshot)}["torch-companions"]
    assert two.detail == "torchvision 0.28.0+cpu, torchaudio 2.13.0+cpu match torch 2.13.0+cpu"


@pytest.mark.parametrize("status", ["warn", "fail"])
def test_a_warn_or_fail_without_a_fix_is_refused(status):
    with pytest.raises(ValueError, match=f"check 'x' is {status} without a fix"):
        Check(id="x", status=status, detail="broken", fix=None)
    assert Check(id="x", status=status, detail="broken", fix="do this").fix == "do this"
    assert Check(id="x", status="ok", detail="fine", fix=None).fix is None


def test_visible_devices_cuda_stops_at_the_first_bad_entry():
    snap = load_snapshot(FIXTURES / "visible-devices-out-of-range.json")
    snap.env["CUDA_VISIBLE_DEVICES"] = "0,2,-1,1"
    check = judge(snap).check("visible-devices")
    assert check.status == "fail" and "CUDA sees only 0, 2" in check.detail
    assert check.fix == "export CUDA_VISIBLE_DEVICES=0,2,1"
    snap.env["CUDA_VISIBLE_DEVICES"] = f"{snap.driver.gpus[3].uuid[:12]},{snap.driver.gpus[0].uuid}"
    snap.torch = None
    check = judge(snap).check("visible-devices")
    assert check.status == "ok" and "GPU 3 as cuda:0, GPU 0 as cuda:1" in check.detail
    snap.env["CUDA_VISIBLE_DEVICES"] = "-1"
    assert judge(snap).check("visible-devices").status == "warn"


def test_cuda_that_will_not_start_is_blamed_on_visible_devices_only_when_they_hide_every_gpu():
    # Slurm and Kubernetes set CUDA_VISIBLE_DEVICES to real GPUs: unsetting it would not start CUDA.
    snap = load_snapshot(FIXTURES / "visible-devices-out-of-range.json")
    snap.torch.warnings = ["CUDA initialization: CUDA driver initialization failed, you might not have a CUDA gpu."]
    for listed in ("0", "2,3", snap.driver.gpus[1].uuid):
        snap.env["CUDA_VISIBLE_DEVICES"] = listed
        check = judge(snap).check("cuda-available")
        assert check.status == "fail" and "CUDA_VISIBLE_DEVICES" not in (check.fix or ""), (listed, check.fix)
        assert "nvidia-smi" in (check.fix or "")
    for hiding in ("4,5", "-1", "", "NoDevFiles"):
        snap.env["CUDA_VISIBLE_DEVICES"] = hiding
        assert "unset CUDA_VISIBLE_DEVICES" in (judge(snap).check("cuda-available").fix or ""), hiding


@pytest.mark.parametrize(
    ("name", "value", "status", "words"),
    [
        ("NCCL_P2P_DISABLE", "1", "warn", "NCCL_P2P_DISABLE set, which slows collectives between this machine's"),
        ("NCCL_P2P_DISABLE", "0x1", "warn", "NCCL_P2P_DISABLE set, which slows collectives"),  # strtol, base 0
        ("NCCL_IB_DISABLE", "2", "ok", "NCCL_IB_DISABLE set, which slows only collectives between nodes"),  # not 0
        ("NCCL_P2P_DISABLE", "false", "ok", "NCCL 2.26.2"),  # NCCL reads 0: P2P stays on, nothing slows
        ("NCCL_SHM_DISABLE", "0", "ok", "NCCL 2.26.2"),
        ("NCCL_P2P_DISABLE", "true", "warn", "ignores NCCL_P2P_DISABLE='true'"),  # read as 0: P2P stays on
        ("NCCL_SHM_DISABLE", "2", "warn", "ignores NCCL_SHM_DISABLE='2'"),  # only 1 turns shared memory off
        ("NCCL_IB_DISABLE", "yes", "warn", "ignores NCCL_IB_DISABLE='yes'"),
    ],
)
def test_nccl_switches_are_read_as_nccl_reads_them(name, value, status, words):
    snap = load_snapshot(FIXTURES / "nccl-p2p-disabled.json")
    snap.env = {name: value}
    check = judge(snap).check("nccl")
    assert check.status == status and words in check.detail, check
    if status == "warn":
        assert f"unset {name}" in (check.fix or "")


def test_visible_devices_on_a_single_gpu_speaks_of_the_gpu():
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    snap.env["CUDA_VISIBLE_DEVICES"] = "-1"
    assert judge(snap).check("visible-devices").detail == "CUDA_VISIBLE_DEVICES='-1' hides the GPU"
    snap.env["CUDA_VISIBLE_DEVICES"] = "1"
    check = judge(snap).check("visible-devices")
    assert check.detail == "CUDA_VISIBLE_DEVICES='1': '1' is not the GPU (0), so CUDA sees no GPU", check.detail
    snap = load_snapshot(FIXTURES / "visible-devices-out-of-range.json")
    assert judge(snap).check("visible-devices").detail.startswith("CUDA_VISIBLE_DEVICES='4,5': '4' names none of the 4")
    snap.env["CUDA_VISIBLE_DEVICES"] = ""
    assert judge(snap).check("visible-devices").detail == "CUDA_VISIBLE_DEVICES='' hides all 4 GPUs"


@pytest.mark.parametrize(
    ("value", "status"),
    [
        ("4", "ok"),
        (" 4", "ok"),
        ("4,2", "ok"),
        ("0", "warn"),
        ("-2", "warn"),
        ("four", "warn"),
        ("", "warn"),
        ("1x", "warn"),
        ("1.5", "warn"),
    ],  # OpenMP refuses these whole: before, "ok" for the 1 torch would read
)
def test_omp_num_threads_is_read_as_torch_reads_it(value, status):
    # torch takes the leading integer (std::stoi): OpenMP's nested list "4,2" runs 4 threads, as " 4" does
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    snap.env["OMP_NUM_THREADS"] = value
    snap.torch.num_threads = 4
    check = judge(snap).check("cpu-threads")
    assert check.status == status, check
    if status == "warn":
        assert check.detail == f"OMP_NUM_THREADS={value!r} is not a positive integer"


def test_indices_on_mixed_gpus_need_the_pci_order():
    # CUDA numbers mixed models fastest first: CUDA_VISIBLE_DEVICES=0 may be nvidia-smi's GPU 1.
    snap = load_snapshot(FIXTURES / "visible-devices-out-of-range.json")
    snap.driver.gpus[0].name = "Tesla T4"
    snap.torch = None
    snap.env["CUDA_VISIBLE_DEVICES"] = "0,1"
    check = judge(snap).check("visible-devices")
    assert check.status == "warn" and check.fix == "export CUDA_DEVICE_ORDER=PCI_BUS_ID", check.detail
    snap.env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    assert judge(snap).check("visible-devices").status == "ok"
    del snap.env["CUDA_DEVICE_ORDER"]
    snap.env["CUDA_VISIBLE_DEVICES"] = snap.driver.gpus[1].uuid  # a UUID names one GPU whatever the order
    assert judge(snap).check("visible-devices").status == "ok"


# Facts that vary wildly between machines, to show no check raises on any combination of them.
_text = st.one_of(st.none(), st.text(max_size=12), st.sampled_from(["12.8", "2.7.1+cu128", "570.26", "9.0", "cu1", ""]))
_number = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**6).map(float))
_cap = st.one_of(st.none(), st.tuples(st.integers(0, 13), st.integers(0, 9)))
_gpu = st.builds(
    GpuFacts, index=st.integers(0, 8), name=st.text(max_size=8), uuid=st.text(max_size=10), capability=_cap
)
_measurement = st.builds(
    Measurement,
    device=st.sampled_from(["cpu", "cuda:0", "cuda:1", "mps", "cuda:x"]),
    error=st.one_of(st.none(), st.text(max_size=20)),
    max_rel_err=_number,
    fp32_tflops=_number,
    lowp_tflops=_number,
    conv_rel_err=_number,
    h2d_pageable_gbps=_number,
    h2d_pinned_gbps=_number,
)
_torch = st.builds(
    TorchFacts,
    import_error=st.one_of(st.none(), st.just("ImportError: undefined symbol: x")),
    version=_text,
    cuda=_text,
    hip=st.one_of(st.none(), st.just("6.2")),
    arch_list=st.lists(st.text(max_size=8) | st.sampled_from(["sm_90", "compute_120", "sm_90a"]), max_size=4),
    imported=st.booleans(),
    release_channels=st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.lists(st.integers(0, 130)))),
    cudnn_version=st.one_of(st.none(), st.integers(0, 10**6)),
    num_threads=st.one_of(st.none(), st.integers(0, 512)),
    cuda_available=st.one_of(st.none(), st.booleans()),
    devices=st.lists(
        st.builds(
            TorchDevice,
            index=st.integers(0, 8),
            name=st.text(max_size=6),
            capability=_cap,
            arch=st.sampled_from(["", "gfx1031", "gfx90a:sramecc+:xnack-", "gfx"]) | st.text(max_size=8),
        )
    ),
    warnings=st.lists(st.text(max_size=20), max_size=2),
)
_snapshots = st.builds(
    Snapshot,
    quick=st.booleans(),
    system=st.builds(
        SystemFacts,
        os=st.sampled_from(["Linux", "Darwin", "Windows", ""]),
        usable_cpus=st.integers(0, 256),
        cpu_quota=st.one_of(st.none(), st.floats(0, 300)),
        container=st.sampled_from([None, "docker", "kubernetes", "apptainer"]),
    ),
    env=st.dictionaries(
        st.sampled_from(["CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_P2P_DISABLE", "LD_LIBRARY_PATH"]),
        st.text(max_size=12),
    ),
    packages=st.dictionaries(
        st.sampled_from(["torch", "torchvision", "torchaudio", "nvidia-cudnn-cu12"]), st.text(max_size=9)
    ),
    shm=st.one_of(st.none(), st.builds(ShmFacts, total_bytes=st.integers(0, 2**40), free_bytes=st.integers(0, 2**40))),
    library_path=st.lists(
        st.builds(LibraryDir, path=st.text(max_size=10), libs=st.lists(st.text(max_size=20), max_size=3))
    ),
    wheel_libs=st.lists(
        st.builds(LibraryDir, path=st.text(max_size=10), libs=st.lists(st.text(max_size=20), max_size=3))
    ),
    driver=st.builds(
        DriverFacts,
        source=st.sampled_from([None, "nvml", "nvidia-smi"]),
        error=_text,
        version=_text,
        cuda_version=_text,
        kernel_module_version=_text,
        gpus=st.lists(_gpu, max_size=3),
    ),
    amd=st.one_of(
        st.none(),
        st.builds(
            AmdFacts,
            kfd=st.booleans(),
            kfd_access=st.booleans(),
            render_nodes=st.lists(st.text(max_size=8), max_size=2),
            render_access=st.lists(st.text(max_size=8), max_size=2),
        ),
    ),
    torch=st.one_of(st.none(), _torch),
    measurements=st.lists(_measurement, max_size=4),
    child=st.one_of(st.none(), st.builds(ChildRun, exit_code=st.one_of(st.none(), st.integers(-70, 3)))),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_snapshots)
def test_no_check_raises_on_any_snapshot(snapshot):
    machine = Machine(snapshot)
    for check_id, check in CHECKS.items():
        result = check(machine)  # called directly: run_checks would hide an exception behind a failed check
        assert result.id == check_id and result.status in ("ok", "warn", "fail", "skip")
        assert result.fix or result.status in ("ok", "skip")
    assert json.dumps(judge(snapshot).to_dict())


def test_quick_snapshots_skip_the_measurements():
    snap = replace(load_snapshot(FIXTURES / "healthy-h100x8.json"), quick=True)
    report = judge(snap)
    assert report.check("device-smoke").status == "skip" and "--quick" in report.check("device-smoke").detail
    assert report.check("h2d-bandwidth").status == "skip"


def as_quick(snap: Snapshot) -> Snapshot:
    """Return what --quick records of the same machine: no child process, torch read from torch/version.py."""
    torch = snap.torch
    facts = None
    if torch is not None:
        facts = TorchFacts(
            imported=False,
            version=torch.version,
            cuda=torch.cuda,
            hip=torch.hip,
            release_channels=torch.release_channels,
        )
    return replace(snap, quick=True, torch=facts, measurements=[], child=None)


def test_quick_on_the_h200_checks_what_needs_no_import_and_says_how_to_check_the_rest():
    report = judge(as_quick(load_snapshot(FIXTURES / "healthy-h200.json")))
    statuses = {c.id: c.status for c in report.checks}
    needs_torch = ["cuda-available", "gpu-arch-supported", "cudnn", "nccl", "cpu-threads"]
    assert statuses == {
        **dict.fromkeys(CHECKS, "ok"),
        **dict.fromkeys([*needs_torch, "mps", "rocm-devices", "device-smoke", "h2d-bandwidth"], "skip"),
    }
    for check_id in needs_torch:
        assert (
            report.check(check_id).detail
            == "skipped in --quick, which does not import torch: run `redline doctor` for this"
        )
    torch_build = report.check("torch-build").detail
    assert torch_build.startswith("torch 2.11.0+cu130: a CUDA 13.0 build for NVIDIA H200") and "--quick" in torch_build
    assert "needs 580.65.06 or newer" in report.check("driver-runtime-compat").detail
    assert [(d.id, d.name, d.usable) for d in report.devices] == [
        ("cpu", "Intel(R) Xeon(R) Processor", True),
        ("gpu:0", "NVIDIA H200", None),  # --quick did not ask torch whether it sees the GPU
    ]
    assert report.exit_code == 0


@pytest.mark.parametrize(
    ("name", "check_id", "remedy"),
    [
        ("cpu-wheel-on-gpu", "torch-build", "download.pytorch.org/whl/cu126"),
        ("driver-too-old", "driver-runtime-compat", "upgrade the NVIDIA driver to 580.65.06"),
        ("torchvision-mismatch", "torch-companions", "--no-deps torchvision==0.19.*"),
        ("shm-64mb-docker", "shm-size", "--ipc=host"),
    ],
)
def test_quick_still_fails_what_it_can_see_without_importing_torch(name, check_id, remedy):
    report = judge(as_quick(load_snapshot(FIXTURES / f"{name}.json")))
    check = report.check(check_id)
    assert check.status == "fail" and remedy in (check.fix or ""), check
    assert report.exit_code == 1


def test_quick_says_so_when_it_could_not_read_torchs_version():
    snap = as_quick(load_snapshot(FIXTURES / "healthy-cpu-laptop.json"))
    snap.torch, snap.probe_errors["torch"] = None, "FileNotFoundError: /site/torch/version.py"
    check = judge(snap).check("torch-build")
    assert check.status == "warn" and "FileNotFoundError: /site/torch/version.py" in check.detail
    assert check.fix == "run `redline doctor` without --quick: it imports torch and reports what fails"


@pytest.mark.parametrize(
    ("installed", "fix"),
    [
        ("2.11.0", "pip install --force-reinstall torch==2.11.0"),  # PyPI's default wheel
        (
            "2.7.1+cu128",
            "pip install --force-reinstall torch==2.7.1 --index-url https://download.pytorch.org/whl/cu128",
        ),
        ("2.13.0+cpu", "pip install --force-reinstall torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"),
        (None, "pip install --force-reinstall torch"),
        # an NGC container's, a source build's: no index of that name (the fix was a URL that answers 404)
        ("2.6.0a0+ecf3bae40a.nv25.01", "torch 2.6.0a0+ecf3bae40a.nv25.01 was not built by download.pytorch.org"),
        ("2.8.0a0+gitabc123", "torch 2.8.0a0+gitabc123 was not built by download.pytorch.org"),
    ],
)
def test_a_torch_that_fails_to_import_is_reinstalled_from_the_index_its_build_came_from(installed, fix):
    snap = Snapshot(
        system=SystemFacts(os="Linux"),
        packages={} if installed is None else {"torch": installed},
        torch=TorchFacts(import_error="ImportError: libcudart.so.12: cannot open shared object file"),
    )
    check = judge(snap).check("torch-build")
    assert check.status == "fail" and "libcudart.so.12" in check.detail
    assert (check.fix or "").startswith(fix) and ("--index-url" in fix) == ("--index-url" in (check.fix or ""))


def test_the_json_keys_docs_doctor_md_shows_are_the_ones_doctor_json_prints():
    text = (Path(__file__).parents[2] / "docs" / "doctor.md").read_text(encoding="utf-8")
    example = text[text.index("`--json` prints") :].split("```")[1]
    shown = set(re.findall(r'"([a-z_0-9-]+)":', example))
    report = report_of("healthy-h200").to_dict()
    printed = {*report, *report["checks"][0], *report["devices"][0], *report["versions"]}
    assert shown == printed


def test_a_rocm_container_without_the_devices_is_told_to_pass_them_and_not_to_run_nvidia_smi():
    snap = load_snapshot(FIXTURES / "rocm-kfd-permission.json")
    snap.system.container = "docker"
    report = judge(snap)
    for check_id in ("rocm-devices", "cuda-available"):
        check = report.check(check_id)
        assert check.status == "fail" and "--device=/dev/kfd --device=/dev/dri --group-add video" in (check.fix or "")
    snap.amd = AmdFacts()  # no /dev/kfd: the devices were not passed in
    report = judge(snap)
    check = report.check("rocm-devices")
    assert check.status == "skip" and "docker run --device=/dev/kfd --device=/dev/dri" in check.detail, check
    assert report.check("cuda-available").status == "skip"


def test_a_rocm_gpu_that_will_not_start_is_sent_to_rocminfo_never_to_nvidia_smi():
    snap = load_snapshot(FIXTURES / "rocm-kfd-permission.json")
    assert snap.amd is not None
    snap.amd.kfd_access, snap.amd.render_access = True, list(snap.amd.render_nodes)
    report = judge(snap)
    assert report.check("rocm-devices").status == "ok"
    check = report.check("cuda-available")
    assert check.status == "fail" and "rocminfo" in (check.fix or "") and "nvidia" not in (check.fix or ""), check
    snap.amd.render_access = []
    check = judge(snap).check("rocm-devices")
    assert check.status == "fail" and "/dev/dri/renderD128" in check.detail and "usermod" in (check.fix or "")


def test_an_amd_gpu_under_a_cpu_torch_is_pointed_at_a_rocm_build():
    snap = load_snapshot(FIXTURES / "healthy-cpu-laptop.json")
    snap.amd = AmdFacts(kfd=True, kfd_access=True, render_nodes=["/dev/dri/renderD128"])
    check = judge(snap).check("rocm-devices")
    assert check.status == "warn" and "CPU-only" in check.detail and "whl/rocm" in (check.fix or ""), check


def test_an_apptainer_container_without_the_driver_libraries_is_told_to_run_with_nv():
    # Apptainer binds the host's /dev, so the device files are there; the libraries come only with --nv.
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    snap.system.container = "apptainer"
    snap.driver = DriverFacts(error="NVML: NVML Shared Library Not Found; nvidia-smi: not found", device_nodes=True)
    assert snap.torch is not None  # without the driver's libraries CUDA does not start either
    snap.torch.cuda_available, snap.torch.devices, snap.torch.device_count = False, [], 0
    check = judge(snap).check("nvidia-driver")
    assert check.status == "fail" and check.fix is not None and "apptainer exec --nv" in check.fix, check
    assert "docker" not in check.fix and "apt install" not in check.fix
    snap.shm = ShmFacts(total_bytes=64 * 2**20, free_bytes=64 * 2**20)
    check = judge(snap).check("shm-size")
    assert check.status == "fail" and check.fix is not None and "docker" not in check.fix, check


def test_an_apptainer_container_on_rocm_is_told_to_join_the_hosts_groups_not_to_pass_docker_flags():
    snap = load_snapshot(FIXTURES / "rocm-kfd-permission.json")
    snap.system.container = "apptainer"  # it runs as the host's user, with the host's /dev
    check = judge(snap).check("rocm-devices")
    assert (
        check.status == "fail"
        and "usermod -aG render,video" in (check.fix or "")
        and "--device" not in (check.fix or "")
    )
    snap.amd = AmdFacts()
    assert "apptainer exec --rocm" in judge(snap).check("rocm-devices").detail


@pytest.mark.parametrize(
    ("error", "container", "words"),
    [
        (
            "NVML: GPU is lost; nvidia-smi: Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost",
            None,
            "reboot to recover it",
        ),
        (
            "NVML: Insufficient Permissions; nvidia-smi: Failed to initialize NVML: Insufficient Permissions",
            None,
            "ls -l /dev/nvidia*",
        ),
        (
            "NVML: Driver Not Loaded; nvidia-smi: NVIDIA-SMI has failed because it couldn't communicate with the "
            "NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running.",
            None,
            "sudo modprobe nvidia",
        ),
        (
            "NVML: Unknown Error; nvidia-smi: Failed to initialize NVML: Unknown Error",
            "docker",
            "delete the container and start it again",
        ),
    ],
    ids=["gpu-lost", "no-permission", "module-not-loaded", "container-detached"],
)
def test_a_driver_that_refuses_to_answer_gets_the_fix_for_its_reason_not_a_reinstall(error, container, words):
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    snap.system.container = container
    snap.driver = DriverFacts(error=error, device_nodes=True)  # the driver is installed: its device files are there
    assert snap.torch is not None
    snap.torch.cuda_available, snap.torch.devices, snap.torch.device_count = False, [], 0
    snap.torch.warnings = ["CUDA initialization: Unexpected error from cudaGetDeviceCount(). Error 999: unknown error"]
    report = judge(snap)
    for check_id in ("nvidia-driver", "cuda-available"):
        check = report.check(check_id)
        assert check.status == "fail" and words in (check.fix or ""), (check_id, check)
        assert "apt install" not in (check.fix or "") and "--gpus all" not in (check.fix or "")


def test_a_kubernetes_pod_is_told_to_request_its_gpus_not_to_pass_docker_flags():
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    snap.system.container = "kubernetes"
    snap.driver = DriverFacts(error="NVML: NVML Shared Library Not Found; nvidia-smi: not found", device_nodes=True)
    assert snap.torch is not None  # without the driver's libraries CUDA does not start either
    snap.torch.cuda_available, snap.torch.devices, snap.torch.device_count = False, [], 0
    check = judge(snap).check("nvidia-driver")
    assert check.status == "fail" and "nvidia.com/gpu" in (check.fix or "") and "--gpus" not in (check.fix or "")
    snap.driver.device_nodes = False  # a pod that asked for no GPU sees neither the files nor the libraries
    report = judge(snap)
    assert "nvidia.com/gpu" in report.check("nvidia-driver").detail
    rocm = load_snapshot(FIXTURES / "rocm-kfd-permission.json")
    rocm.system.container = "kubernetes"
    check = judge(rocm).check("rocm-devices")
    assert check.status == "fail" and "supplementalGroups" in (check.fix or "") and "--device" not in (check.fix or "")
    rocm.amd = AmdFacts()
    assert "amd.com/gpu" in judge(rocm).check("rocm-devices").detail


def test_a_wrong_convolution_on_a_rocm_gpu_fails_as_on_a_cuda_one():
    snap = load_snapshot(FIXTURES / "healthy-mi300x8.json")
    check = judge(snap).check("cudnn")
    assert check.status == "ok" and "a convolution on cuda:0-7 matches the CPU" in check.detail, check
    snap.measurements = [replace(r, conv_rel_err=0.4) if r.device == "cuda:3" else r for r in snap.measurements]
    report = judge(snap)
    check = report.check("cudnn")
    assert check.status == "fail" and "cuda:3 disagrees with the CPU" in check.detail and report.exit_code == 1


@pytest.mark.parametrize(
    ("name", "arch", "words"),
    [
        ("AMD Radeon RX 6700 XT", "gfx1031", "export HSA_OVERRIDE_GFX_VERSION=10.3.0"),  # gfx1030's kernels
        ("AMD Radeon RX 5700 XT", "gfx1010", "PYTORCH_ROCM_ARCH=gfx1010"),  # no gfx101x in the wheel
    ],
)
def test_an_amd_gpu_the_rocm_wheel_has_no_kernels_for_fails_with_the_way_to_run_it(name, arch, words):
    snap = load_snapshot(FIXTURES / "healthy-mi300x8.json")
    check = judge(snap).check("gpu-arch-supported")
    assert check.status == "ok" and check.detail.startswith("AMD Instinct MI300X (gfx942) covered"), check
    assert snap.torch is not None
    snap.torch.devices = [replace(snap.torch.devices[0], name=name, arch=arch)]
    check = judge(snap).check("gpu-arch-supported")
    assert check.status == "fail" and f"{name} ({arch}) not among the wheel's targets" in check.detail, check
    assert words in (check.fix or ""), check.fix


def test_amd_targets_are_read_as_rocm_numbers_them():
    assert [gfx_version(t) for t in ("gfx90a:sramecc+:xnack-", "gfx1031", "gfx942", "gfx1151", "sm_90")] == [
        (9, 0, 10),
        (10, 3, 1),
        (9, 4, 2),
        (11, 5, 1),
        None,
    ]


def test_a_rocm_build_reports_miopens_version_as_miopen_not_as_a_garbled_cudnn():
    # Under ROCm torch.backends.cudnn.version() is MIOpen's, major * 1000000 + minor * 1000 + patch.
    report = report_of("healthy-mi300x8")
    assert (report.versions["cudnn"], report.versions["miopen"]) == (None, "3.3.0")
    assert "MIOpen 3.3.0" in report.check("cudnn").detail
    assert (report_of("healthy-h200").versions["cudnn"], report_of("healthy-h200").versions["miopen"]) == (
        "9.19.0",
        None,
    )


@pytest.mark.parametrize(
    ("stage", "fix_starts"),
    [("cpu", 'run `python -c "import torch; print((torch.randn'), ("import", 'run `python -c "import torch"`')],
)
def test_a_child_that_died_outside_cuda_is_not_sent_to_the_nvidia_driver(stage, fix_starts):
    """Before, a crash measuring the CPU (or importing torch) on a machine without a GPU got the driver's fix."""
    snap = load_snapshot(FIXTURES / "healthy-cpu-laptop.json")
    snap.child = replace(snap.child, exit_code=-11, unfinished_stage=stage)
    snap.measurements = [r for r in snap.measurements if r.device != "cpu"]
    fix = Machine(snap).child_fix()
    assert fix.startswith(fix_starts) and "nvidia" not in fix.lower() and "dmesg" not in fix
    if stage == "cpu":
        cpu = next(device for device in judge(snap).devices if device.id == "cpu")
        assert cpu.error == "not measured: the child process measuring it was killed by SIGSEGV"
    snap.child = replace(snap.child, unfinished_stage="cuda:0")
    assert "dmesg" in Machine(snap).child_fix()  # a CUDA stage keeps the driver's


@pytest.mark.parametrize(("container", "words"), [("docker", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"),
                                                  (None, "apt install nvidia-utils")])  # fmt: skip
def test_a_gpu_torch_runs_on_without_nvml_is_a_warning_with_the_utility_libraries_to_add(container, words):
    """NVIDIA_DRIVER_CAPABILITIES=compute mounts libcuda alone: the run failed with `docker run --gpus all`, which it
    had, and torch-build said the machine had no NVIDIA GPU while cuda-available listed it."""
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    snap.system.container = container
    snap.driver = DriverFacts(error="NVML: NVML Shared Library Not Found; nvidia-smi: not found", device_nodes=True)
    report = judge(snap)
    check = report.check("nvidia-driver")
    assert check.status == "warn" and check.detail.startswith("torch runs on NVIDIA H200, but NVIDIA's management")
    assert words in (check.fix or "") and "--gpus all" not in (check.fix or "")
    build = report.check("torch-build")
    assert build.status == "ok" and "for NVIDIA H200" in build.detail and "no NVIDIA GPU" not in build.detail
    assert report.exit_code == 0


def test_an_amd_gpu_under_a_cuda_torch_is_pointed_at_a_rocm_build():
    """A plain `pip install torch` on Linux gives the CUDA wheel: on an AMD machine every check passed, on the CPU."""
    snap = load_snapshot(FIXTURES / "healthy-cpu-laptop.json")
    assert snap.torch is not None
    snap.torch.cuda, snap.packages["torch"], snap.torch.version = "12.8", "2.13.0+cu128", "2.13.0+cu128"
    snap.amd = AmdFacts(kfd=True, kfd_access=True, render_nodes=["/dev/dri/renderD128"])
    check = judge(snap).check("rocm-devices")
    assert check.status == "warn" and "a CUDA build, which runs on NVIDIA GPUs alone" in check.detail, check
    assert "whl/rocm" in (check.fix or "")


def test_a_driver_too_old_for_every_fitting_wheel_is_asked_the_least_upgrade():
    """An sm_120 GPU on driver 560: the fix asked for 580 and CUDA 13.0's wheel, where 12.8's runs it on 570."""
    snap = load_snapshot(FIXTURES / "sm120-gpu-old-wheel.json")
    snap.driver.version = snap.driver.kernel_module_version = "560.35.03"
    snap.driver.cuda_version = "12.6"
    check = judge(snap).check("gpu-arch-supported")
    assert check.status == "fail" and "upgrade the NVIDIA driver to 570.26 or newer" in (check.fix or ""), check.fix
    assert "whl/cu128" in (check.fix or "")


def test_nccl_says_a_switch_that_slows_and_one_it_ignores_together():
    """Only the first kind was said: NCCL_IB_DISABLE=true, which the user thinks turned InfiniBand off, went unsaid."""
    snap = load_snapshot(FIXTURES / "nccl-p2p-disabled.json")
    snap.env = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "true"}
    check = judge(snap).check("nccl")
    assert check.status == "warn" and "NCCL_P2P_DISABLE set, which slows" in check.detail, check
    assert "ignores NCCL_IB_DISABLE='true'" in check.detail
    assert "unset NCCL_P2P_DISABLE" in (check.fix or "") and "unset NCCL_IB_DISABLE" in (check.fix or "")


def test_a_stray_comma_in_visible_devices_loses_no_gpu_and_is_a_warning():
    """'0,1,' failed the run as if a GPU were lost: CUDA stops at the empty entry, after every GPU listed."""
    snap = load_snapshot(FIXTURES / "visible-devices-out-of-range.json")
    snap.env["CUDA_VISIBLE_DEVICES"] = "0,1,"
    check = judge(snap).check("visible-devices")
    assert check.status == "warn" and "it sees 0, 1, every GPU listed" in check.detail, check
    assert check.fix == "export CUDA_VISIBLE_DEVICES=0,1"
    snap.env["CUDA_VISIBLE_DEVICES"] = "0,,1"  # one comma too many in the middle: GPU 1 is lost
    assert judge(snap).check("visible-devices").status == "fail"


def test_cuda_launch_blocking_left_set_is_a_warning_on_a_working_gpu():
    """Recorded in the snapshot and read by no check: a leftover CUDA_LAUNCH_BLOCKING=1 passed without a word."""
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    snap.env["CUDA_LAUNCH_BLOCKING"] = "1"
    check = judge(snap).check("cuda-available")
    assert check.status == "warn" and "CUDA_LAUNCH_BLOCKING=1 makes every kernel launch wait" in check.detail
    assert (check.fix or "").startswith("unset CUDA_LAUNCH_BLOCKING")
    snap.env["CUDA_LAUNCH_BLOCKING"] = "0"
    assert judge(snap).check("cuda-available").status == "ok"
