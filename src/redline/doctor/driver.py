"""Read the NVIDIA driver and its GPUs without initialising CUDA: NVML first, `nvidia-smi` second.

NVML (nvidia-ml-py, imported as ``pynvml``) is what nvidia-smi, nvitop and gpustat are built on;
nvidia-smi's own output "is not guaranteed to be backward compatible" (its man page), so it is
only the fallback for a Python without nvidia-ml-py. An NVML call that hangs in a broken driver is
given up on after a deadline instead of hanging the doctor.
"""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from redline.doctor.snapshot import DriverFacts, GpuFacts

NVML_TIMEOUT_S = 10.0
SMI_FIELDS = "index,name,uuid,compute_cap,memory.total,pci.bus_id,driver_version"

T = TypeVar("T")


def probe_driver(wsl: bool = False) -> DriverFacts:
    """Return the driver's version and GPUs, or the reason neither NVML nor nvidia-smi could say."""
    errors = []
    try:
        facts = with_deadline(read_nvml, NVML_TIMEOUT_S)
    except Exception as exc:  # every failure is a finding, reported in `error`
        errors.append(f"NVML: {exc}")
        try:
            facts = read_nvidia_smi()
        except Exception as smi_exc:
            errors.append(f"nvidia-smi: {smi_exc}")
            facts = DriverFacts()
    facts.error = "; ".join(errors) or None
    facts.kernel_module_version = kernel_module_version()
    facts.device_nodes = (
        Path("/dev/nvidiactl").exists() or Path("/dev/nvidia0").exists() or (wsl and Path("/dev/dxg").exists())
    )
    return facts


def with_deadline(fn: Callable[[], T], timeout_s: float, what: str = "a driver call") -> T:
    """Run ``fn`` on a daemon thread and return its result; raise TimeoutError, saying ``what`` hung, if it overruns."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the caller below
            box["error"] = exc

    thread = threading.Thread(target=target, name="redline-doctor-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s ({what} hung)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def read_nvml() -> DriverFacts:
    import pynvml  # nvidia-ml-py: loads libnvidia-ml only when nvmlInit() is called

    pynvml.nvmlInit()
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # 12040 for CUDA 12.4
        gpus = [_nvml_gpu(pynvml, index) for index in range(pynvml.nvmlDeviceGetCount())]
        return DriverFacts(
            source="nvml",
            version=_str(pynvml.nvmlSystemGetDriverVersion()),
            cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
            gpus=gpus,
        )
    finally:
        pynvml.nvmlShutdown()


def _nvml_gpu(pynvml: Any, index: int) -> GpuFacts:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    return GpuFacts(
        index=index,
        name=_str(pynvml.nvmlDeviceGetName(handle)),
        uuid=_str(pynvml.nvmlDeviceGetUUID(handle)),
        capability=(int(major), int(minor)),
        mem_total_gib=_optional(lambda: round(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30, 2)),
        pci_bus_id=_optional(lambda: _str(pynvml.nvmlDeviceGetPciInfo(handle).busId)) or "",
    )


def _optional(read: Callable[[], T]) -> T | None:
    """Read a field some GPUs do not report (NVML answers "Not Supported"); None then."""
    try:
        return read()
    except Exception:  # a missing detail must not lose the whole GPU
        return None


def _str(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_nvidia_smi() -> DriverFacts:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=NVML_TIMEOUT_S,
        )
    except FileNotFoundError:
        raise RuntimeError("not found") from None
    if out.returncode != 0:  # "Failed to initialize NVML: Driver/library version mismatch", say
        lines = (out.stdout + out.stderr).strip().splitlines()
        raise RuntimeError(lines[0] if lines else f"exit code {out.returncode}")
    return parse_nvidia_smi(out.stdout)


def parse_nvidia_smi(text: str) -> DriverFacts:
    """Parse ``nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader,nounits``."""
    gpus, version = [], None
    for line in text.strip().splitlines():
        index, name, uuid, cap, mem_mib, bus, version = (part.strip() for part in line.split(","))
        cap_match = re.fullmatch(r"(\d+)\.(\d+)", cap, re.ASCII)  # "9.0"; "[N/A]" on old GPUs
        gpus.append(
            GpuFacts(
                index=int(index),
                name=name,
                uuid=uuid,
                capability=(int(cap_match[1]), int(cap_match[2])) if cap_match else None,
                mem_total_gib=round(float(mem_mib) / 1024, 2) if _is_number(mem_mib) else None,
                pci_bus_id=bus,
            )
        )
    return DriverFacts(source="nvidia-smi", version=version, gpus=gpus)


def _is_number(text: str) -> bool:
    return re.fullmatch(r"\d+(\.\d+)?", text, re.ASCII) is not None


def kernel_module_version(path: str = "/proc/driver/nvidia/version") -> str | None:
    """Return the loaded kernel module's version: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07 ..."."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    match = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None
