"""Gather the facts of this machine into a Snapshot; no probe raises, none starts CUDA here.

In this process: the OS, Python, environment, installed distributions (read from their metadata,
never imported), /dev/shm, the CUDA libraries on LD_LIBRARY_PATH and in the wheel, and the driver
through NVML. Everything that imports torch runs in a child process with a deadline
(``redline.doctor.child``), started first so that it imports torch and starts CUDA while this
process probes the rest. ``quick`` starts no child: torch's version and build are read from
torch/version.py instead, and what only an imported torch can say stays unprobed. A probe that
raises leaves its facts at their defaults and records the error under ``probe_errors``.
"""

from __future__ import annotations

import ast
import datetime as dt
import importlib.metadata
import importlib.util
import os
import platform
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from redline.doctor import child as child_process
from redline.doctor.driver import NVML_TIMEOUT_S, probe_driver, with_deadline
from redline.doctor.snapshot import AmdFacts, LibraryDir, PythonFacts, ShmFacts, Snapshot, SystemFacts, TorchFacts
from redline.hardware.cgroup import cpu_limit_cores

# The environment variables the checks read; only those that are set are recorded.
ENV_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "NCCL_IB_DISABLE",
    "PYTORCH_ENABLE_MPS_FALLBACK",
    "CUDA_LAUNCH_BLOCKING",
    # torch's own settings that stop it when it refuses their value (checks/machine.py, TORCH_SETTINGS)
    "TORCH_LOGS",
    "TORCH_LOGS_FORMAT",
    "TORCH_LOGS_OUT",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
)
APPTAINER_ENV = ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER")
PACKAGES = ("torch", "torchvision", "torchaudio", "triton", "numpy", "nvidia-ml-py")
# The CUDA libraries torch loads; a file of one of these on LD_LIBRARY_PATH can shadow the wheel's.
CUDA_LIB = re.compile(
    r"lib(cudart|cublas|cublasLt|cudnn\w*|nccl|nvJitLink|cusparse\w*|cufft|curand|cusolver|nvrtc|cupti)\.so(\.\d+)*"
)

# A probe that blocks past this is abandoned: listing a directory of LD_LIBRARY_PATH on a stale network
# mount blocks in the kernel for good. The driver's probe waits for NVML, then for nvidia-smi, each with its own.
PROBE_TIMEOUT_S = 10.0
DRIVER_TIMEOUT_S = 2 * NVML_TIMEOUT_S + 5.0

T = TypeVar("T")


def take_snapshot(
    *,
    quick: bool = False,
    child_timeout_s: float = child_process.DEFAULT_TIMEOUT_S,
    child_script: Path = child_process.CHILD_SCRIPT,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
) -> Snapshot:
    """Probe this machine; ``quick`` starts no child process (no torch import, no measurements). Never raises.

    Never hangs either: a probe that has not answered after ``probe_timeout_s`` is abandoned, its error recorded.
    """
    from redline.version import __version__

    snap = Snapshot(
        redline_version=__version__,
        taken_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        quick=quick,
    )
    errors = snap.probe_errors
    child = None if quick else start_child(errors, child_timeout_s, child_script)

    def guard(name: str, probe: Callable[[], T], default: T, timeout_s: float = probe_timeout_s) -> T:
        return _guard(errors, name, probe, default, timeout_s)

    snap.system = guard("system", probe_system, snap.system)
    snap.python = guard("python", lambda: probe_python(snap.system.os), snap.python)
    snap.env = {name: os.environ[name] for name in ENV_VARS if name in os.environ}
    snap.packages = guard("packages", probe_packages, {})
    snap.shm = guard("shm", probe_shm, None)
    snap.library_path = guard("library_path", lambda: library_dirs(snap.env.get("LD_LIBRARY_PATH", "")), [])
    snap.wheel_libs = guard("wheel_libs", wheel_library_dirs, [])
    snap.driver = guard("driver", lambda: probe_driver(snap.system.wsl), snap.driver, DRIVER_TIMEOUT_S)
    if snap.system.os == "Linux":
        snap.amd = guard("amd", probe_amd, None)
        snap.infiniband = guard("infiniband", probe_infiniband, None)
    if quick:
        snap.torch = guard("torch", read_torch_build, None)
    elif child is not None:
        try:
            child_process.apply_report(snap, *child.wait())
        except Exception as exc:  # a doctor must report, not crash
            errors["child"] = f"{type(exc).__name__}: {exc}"
    return snap


def start_child(errors: dict[str, str], timeout_s: float, script: Path) -> child_process.Child | None:
    """Start the child that imports torch; None, with the reason in ``errors``, when it cannot start."""
    try:
        return child_process.Child(timeout_s=timeout_s, script=script)
    except Exception as exc:  # the interpreter would not start, say: torch-build reports it
        errors["child"] = f"{type(exc).__name__}: {exc}"
        return None


def _guard(errors: dict[str, str], name: str, probe: Callable[[], T], default: T, timeout_s: float) -> T:
    try:
        return with_deadline(probe, timeout_s, what=f"the {name} probe")
    except Exception as exc:  # the error is itself a fact
        errors[name] = f"{type(exc).__name__}: {exc}"
        return default


def probe_system() -> SystemFacts:
    system = platform.system()
    return SystemFacts(
        os=system,
        release=platform.release(),
        machine=platform.machine(),
        mac_version=(platform.mac_ver()[0] or None) if system == "Darwin" else None,
        wsl="microsoft" in _read("/proc/version").lower(),
        container=container_kind(),
        cpu_name=cpu_name(system),
        logical_cpus=os.cpu_count() or 1,
        usable_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
        cpu_quota=cpu_limit_cores(),
    )


def probe_python(system: str) -> PythonFacts:
    return PythonFacts(
        version=platform.python_version(),
        implementation=platform.python_implementation(),
        bits=struct.calcsize("P") * 8,
        executable=sys.executable,
        translated=system == "Darwin" and _command(["sysctl", "-n", "sysctl.proc_translated"]) == "1",
    )


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _command(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def container_kind() -> str | None:
    """Name the container runtime this process runs under, if any."""
    # Apptainer (formerly Singularity) passes the host's environment through, KUBERNETES_* included, and
    # marks its own containers with APPTAINER_CONTAINER (SINGULARITY_CONTAINER) and /.singularity.d.
    if any(os.environ.get(name) for name in APPTAINER_ENV) or Path("/.singularity.d").is_dir():
        return "apptainer"
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    if Path("/.dockerenv").exists():
        return "docker"
    if Path("/run/.containerenv").exists():
        return "podman"
    cgroup = _read("/proc/1/cgroup")
    for marker, kind in (("kubepods", "kubernetes"), ("docker", "docker"), ("containerd", "containerd")):
        if marker in cgroup:
            return kind
    return None


def cpu_name(system: str) -> str:
    if system == "Darwin":
        return _command(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.processor()
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def probe_amd(dev: Path = Path("/dev")) -> AmdFacts:
    """Read which of AMD's GPU device files exist and which this process may open read-write, as ROCm does."""

    def usable(path: Path) -> bool:
        return os.access(path, os.R_OK | os.W_OK)

    kfd = dev / "kfd"
    nodes = sorted(dev.glob("dri/renderD*"), key=lambda p: (len(p.name), p.name))
    return AmdFacts(
        kfd=kfd.exists(),
        kfd_access=kfd.exists() and usable(kfd),
        render_nodes=[str(p) for p in nodes],
        render_access=[str(p) for p in nodes if usable(p)],
    )


def probe_infiniband(sysfs: Path = Path("/sys/class/infiniband")) -> list[str]:
    """List the RDMA devices the kernel has (mlx5_0, ...): what NCCL's InfiniBand transport, RoCE too, runs on."""
    return sorted(entry.name for entry in sysfs.iterdir()) if sysfs.is_dir() else []


def probe_packages() -> dict[str, str]:
    """Return the versions of torch, its companions and every nvidia-* distribution, from metadata."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in PACKAGES or name.startswith("nvidia-"):
            found[name] = dist.version
    return dict(sorted(found.items()))


def probe_shm(path: str = "/dev/shm") -> ShmFacts | None:
    if not os.path.isdir(path):
        return None
    stat = os.statvfs(path)
    return ShmFacts(path=path, total_bytes=stat.f_blocks * stat.f_frsize, free_bytes=stat.f_bavail * stat.f_frsize)


def library_dirs(search_path: str) -> list[LibraryDir]:
    """List each directory of a PATH-style string with the CUDA libraries in it."""
    return [LibraryDir(path=entry, libs=cuda_libs(entry)) for entry in search_path.split(os.pathsep) if entry]


def cuda_libs(directory: str) -> list[str]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(name for name in names if CUDA_LIB.fullmatch(name))


def wheel_library_dirs() -> list[LibraryDir]:
    """List the nvidia-* wheels' library directories that torch's RUNPATH points at (../../nvidia/*/lib)."""
    spec = importlib.util.find_spec("torch")  # locates torch without importing it
    if spec is None or spec.origin is None:
        return []
    nvidia = Path(spec.origin).parent.parent / "nvidia"
    if not nvidia.is_dir():
        return []
    return [LibraryDir(path=str(lib), libs=cuda_libs(str(lib))) for lib in sorted(nvidia.glob("*/lib")) if lib.is_dir()]


def read_torch_build() -> TorchFacts:
    """Read torch's version, build and wheel channels from its files, parsed and never run (for --quick).

    Importing torch loads its CUDA libraries, seconds on a GPU machine. torch/version.py, written by
    torch's build, holds plain assignments (``__version__ = '2.7.1+cu128'``, ``cuda = '12.8'``, ``hip``).
    """
    spec = importlib.util.find_spec("torch")  # locates torch without importing it
    if spec is None:  # exactly what `import torch` would raise
        return TorchFacts(imported=False, import_error="ModuleNotFoundError: No module named 'torch'")
    folders = list(spec.submodule_search_locations or [])
    if not folders:
        raise ValueError(f"torch at {spec.origin} is a module, not the torch package")
    path = Path(folders[0]) / "version.py"
    values = literal_assignments(path.read_text(encoding="utf-8"))
    version = values.get("__version__")
    if not isinstance(version, str):
        raise ValueError(f"{path} assigns no __version__ string")
    cuda, hip = values.get("cuda"), values.get("hip")
    return TorchFacts(
        imported=False,
        version=version,
        cuda=cuda if isinstance(cuda, str) else None,
        hip=hip if isinstance(hip, str) else None,
        release_channels=release_channels(Path(folders[0]) / "cuda" / "__init__.py"),
    )


def release_channels(path: Path) -> dict[str, list[int]] | None:
    """Return torch's own PYTORCH_RELEASES_CODE_CC for this host, read from torch/cuda/__init__.py.

    The same table the child reads from the imported torch: without it the wheel fix falls back to
    redline's table, which may name a channel this torch release is not published on.
    """
    try:
        table = literal_assignments(path.read_text(encoding="utf-8")).get("PYTORCH_RELEASES_CODE_CC")
    except (OSError, SyntaxError, ValueError):  # an older torch without the file, or a newer Python's syntax
        return None
    if not isinstance(table, dict):
        return None
    host = "aarch64" if platform.machine().lower() in ("aarch64", "arm64") else "x86_64"
    return {str(cuda): sorted(by_host.get(host, ())) for cuda, by_host in table.items() if isinstance(by_host, dict)}


def literal_assignments(source: str) -> dict[str, object]:
    """Return the names a module's top level assigns a literal to, without running the module."""
    found: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            try:
                found[target.id] = ast.literal_eval(value)
            except (ValueError, TypeError, SyntaxError):  # not a literal (a call, a name): not a fact we read
                continue
    return found
