"""Checks of the host: Python, shared memory, CPU threads, Apple's MPS."""

from __future__ import annotations

import math
import re

from redline.doctor.checks.machine import NOT_IMPORTED, Machine, gib
from redline.doctor.checks.measured import flops
from redline.doctor.compat import parse_version
from redline.doctor.report import Check, fail, ok, skip, warn

NATIVE_PYTHON_FIX = (
    "install a native arm64 Python (the python.org universal2 installer, or `brew install python`), "
    "then create the environment and install torch with it"
)
# DataLoader workers pass batches through /dev/shm and NCCL puts its intra-node buffers there; Docker
# gives a container 64 MiB unless told otherwise (NVIDIA/nccl#342, pytorch/pytorch README "Docker").
SHM_FAIL_BYTES = 256 * 2**20
SHM_WARN_BYTES = 2**30


def python(m: Machine) -> Check:
    py = m.snap.python
    version = parse_version(py.version)
    if version is None:
        return skip("python", "the snapshot has no Python version")
    detail = f"{py.implementation or 'Python'} {py.version}, {py.bits}-bit, {m.snap.system.machine or 'unknown CPU'}"
    if py.translated:
        return fail(
            "python", f"{detail}: an x86_64 Python under Rosetta 2, so no MPS and emulated CPU code", NATIVE_PYTHON_FIX
        )
    if version[:2] < (3, 10):
        return fail(
            "python", f"{detail}: redline needs Python 3.10 or newer", "install Python 3.12 (`uv python install 3.12`)"
        )
    if py.bits != 64:
        return fail("python", f"{detail}: torch ships 64-bit wheels only", "install a 64-bit Python")
    if py.implementation and py.implementation != "CPython":
        return warn("python", f"{detail}: torch supports CPython only", "create the environment with CPython")
    return ok("python", detail)


def shm_size(m: Machine) -> Check:
    shm = m.snap.shm
    if shm is None:
        return skip("shm-size", f"no /dev/shm on {m.snap.system.os or 'this system'}")
    detail = f"{shm.path}: {gib(shm.total_bytes)}, {gib(shm.free_bytes)} free"
    if m.snap.system.container == "kubernetes":
        grow = "mount an emptyDir with `medium: Memory` (and a sizeLimit such as 16Gi) at /dev/shm in the pod spec"
    elif m.apptainer:
        grow = "Apptainer mounts the host's /dev/shm: enlarge it there (`sudo mount -o remount,size=16G /dev/shm`)"
    elif m.snap.system.container:
        grow = "restart the container with `docker run --ipc=host ...` (or `--shm-size=16g`)"
    else:
        grow = "enlarge it: `sudo mount -o remount,size=16G /dev/shm`"
    if shm.total_bytes < SHM_FAIL_BYTES:
        consequence = "DataLoader workers die with 'Bus error' and NCCL cannot create its shared-memory segments"
        return fail("shm-size", f"{detail}: {consequence}", grow)
    if shm.total_bytes < SHM_WARN_BYTES:
        return warn("shm-size", f"{detail}: enough only for a few workers with small batches", grow)
    if shm.free_bytes < SHM_FAIL_BYTES:
        return warn(
            "shm-size",
            f"{detail}: nearly full, likely segments left by killed runs",
            "list them with `ls -lt /dev/shm` and remove those of processes that are gone (torch_*, nccl-*)",
        )
    return ok("shm-size", detail)


def cpu_threads(m: Machine) -> Check:
    system = m.snap.system
    cores, limit = system.usable_cpus, f"{system.usable_cpus} usable cores"
    if system.cpu_quota is not None and system.cpu_quota < cores:
        cores, limit = max(1, math.floor(system.cpu_quota)), f"a cgroup limit of {system.cpu_quota:g} cores"
    if m.torch is not None and not m.imported:
        return skip("cpu-threads", NOT_IMPORTED)
    if m.torch is None or m.torch.num_threads is None:
        return skip("cpu-threads", "torch did not report its thread count (see torch-build)")
    threads = m.torch.num_threads
    detail = f"torch uses {threads} threads on {limit} ({system.cpu_name or 'CPU'})"
    omp = m.snap.env.get("OMP_NUM_THREADS")
    if omp is not None and not _thread_count(omp):
        return warn(
            "cpu-threads", f"OMP_NUM_THREADS={omp!r} is not a positive integer", f"export OMP_NUM_THREADS={cores}"
        )
    if threads > cores:
        return warn(
            "cpu-threads",
            f"{detail}: more threads than cores, so they contend",
            f"export OMP_NUM_THREADS={cores} (or call torch.set_num_threads({cores}))",
        )
    if threads == 1 and cores >= 4:
        step = "unset OMP_NUM_THREADS" if omp == "1" else f"call torch.set_num_threads({cores})"
        return warn("cpu-threads", f"{detail}: one thread leaves the other cores idle", step)
    cpu = next((r for r in m.snap.measurements if r.device == "cpu" and r.fp32_tflops), None)
    measured = f"; fp32 matmul {flops([cpu.fp32_tflops])}" if cpu and cpu.fp32_tflops else ""  # as device-smoke says
    return ok("cpu-threads", detail + measured)


def _thread_count(value: str) -> int | None:
    """OMP_NUM_THREADS as torch reads it (std::stoi, aten/src/ATen/ParallelCommon.cpp): its leading integer, so
    " 8" and OpenMP's nested list "8,2" give 8; None where torch warns that it is invalid and ignores it, or
    where OpenMP does ("1x", "1.5": libgomp refuses the whole value, and its threads are then as many as cores)."""
    match = re.fullmatch(r"\s*([+-]?\d+)\s*(?:,\s*\d+\s*)*", value)
    count = int(match.group(1)) if match and value.isascii() else 0
    return count if 0 < count < 2**31 else None  # past an int, stoi throws: torch warns too


def mps(m: Machine) -> Check:
    system = m.snap.system
    if system.os != "Darwin":
        return skip("mps", f"not macOS ({system.os or 'unknown OS'})")
    if m.snap.python.translated:
        return fail("mps", "Python runs as x86_64 under Rosetta 2, which has no MPS", NATIVE_PYTHON_FIX)
    if m.torch is None:
        return skip("mps", "torch did not import (see torch-build)")
    if not m.imported:
        return skip("mps", NOT_IMPORTED)
    macos = system.mac_version or "unknown"
    if m.torch.mps_available:
        return ok("mps", f"MPS available on macOS {macos}")
    if not m.torch.mps_built:
        if system.machine != "arm64":
            return skip("mps", "an Intel Mac: recent torch builds have no MPS for x86_64 macOS")
        return warn("mps", f"torch {m.torch.version} was built without MPS", "pip install --force-reinstall torch")
    version = parse_version(system.mac_version)
    if version is not None and version < (14,):
        return fail(
            "mps",
            f"MPS is built but unavailable on macOS {macos}: recent torch needs macOS 14.0 or newer",
            "upgrade macOS to 14 (Sonoma) or newer",
        )
    return fail(
        "mps",
        f"MPS is built but unavailable on macOS {macos}",
        "run `python -c 'import torch; torch.zeros(1, device=\"mps\")'` in a native arm64 terminal to see why; "
        "update macOS and torch",
    )
