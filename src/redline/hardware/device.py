"""Facts about a compute device, gathered once so that every decision about it is a pure function.

``DeviceFacts`` is data: tests build an H100, a V100 or a CPU by hand and feed it to the resolvers
in ``redline.plan``. ``probe_device`` reads the facts of a real device; it is called when a Runtime
is built, never at import, and only touches CUDA when a CUDA device was asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

DeviceType = Literal["cpu", "cuda", "mps"]


@dataclass(frozen=True, kw_only=True)
class DeviceFacts:
    """What the resolvers need to know about one device."""

    type: DeviceType
    name: str
    index: int | None = None
    capability: tuple[int, int] | None = None  # CUDA compute capability, (9, 0) for Hopper
    mem_gib: float | None = None
    cpu_count: int = 1
    cpu_fast_bf16: bool = False  # AMX tiles: the only CPUs where bf16 matmul outruns fp32

    @property
    def bf16(self) -> bool:
        """Whether the device runs bf16 natively (Ampere and newer GPUs, Apple silicon, AMX CPUs)."""
        if self.type == "cuda":
            return self.capability is not None and self.capability >= (8, 0)
        if self.type == "mps":
            return True
        return self.cpu_fast_bf16

    @property
    def tensor_cores(self) -> bool:
        """Whether the GPU has tensor cores (Volta, sm70, and newer)."""
        return self.type == "cuda" and self.capability is not None and self.capability >= (7, 0)

    @property
    def label(self) -> str:
        """Return the torch device string, ``cuda:0`` or ``cpu``."""
        return self.type if self.index is None else f"{self.type}:{self.index}"


@dataclass(frozen=True, kw_only=True)
class Accelerators:
    """Which accelerators this process can see: the input of the device resolver."""

    cuda_count: int = 0
    mps: bool = False


def probe_accelerators() -> Accelerators:
    """Return the accelerators visible to torch (counting CUDA devices creates no CUDA context)."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps_backend = getattr(torch.backends, "mps", None)
    mps = bool(mps_backend is not None and mps_backend.is_available())
    return Accelerators(cuda_count=cuda_count, mps=mps)


def usable_cpu_count() -> int:
    """Return the cores this process may run on (its affinity mask, not the machine's total)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def probe_device(device: torch.device) -> DeviceFacts:
    """Read the facts of ``device``; for CUDA this initialises the CUDA runtime."""
    cpus = usable_cpu_count()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return DeviceFacts(
            type="cuda",
            name=props.name,
            index=index,
            capability=(props.major, props.minor),
            mem_gib=props.total_memory / 2**30,
            cpu_count=cpus,
        )
    if device.type == "mps":
        return DeviceFacts(type="mps", name="Apple MPS", cpu_count=cpus)
    return DeviceFacts(type="cpu", name=_cpu_name(), cpu_count=cpus, cpu_fast_bf16=_cpu_has_amx())


def _cpu_has_amx() -> bool:
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"
