"""Facts about a compute device, gathered once so that every decision about it is a pure function.

``DeviceFacts`` is data: tests build an H100, a V100 or a CPU by hand and feed it to the resolvers
in ``redline.plan``. ``probe_device`` reads the facts of a real device; it is called when a Runtime
is built, never at import, and only touches CUDA when a CUDA device was asked for.

The CPU's instruction set can be faked for planning with ``REDLINE_CPU`` (see ``probe_cpu_isa``):
the Plan is then made as on that CPU, while the maths still runs on this one.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast, get_args

import torch

from redline.errors import ConfigError

DeviceType = Literal["cpu", "cuda", "mps"]

# The CPU's best matrix instructions, best first; they decide how fast bf16 can be there.
# "amx": AMX tiles (Sapphire Rapids and later), bf16 matmuls in hardware; "avx512_bf16": bf16 dot
# products in AVX-512 registers (Cooper Lake, Zen 4) but no tiles; "avx512" and "avx2": no bf16
# dot products; "arm": any 64-bit Arm CPU; "other": x86 without AVX2, POWER, s390x, ...
# Which CPU has which: https://en.wikipedia.org/wiki/AVX-512#CPUs_with_AVX-512
CpuIsa = Literal["amx", "avx512_bf16", "avx512", "avx2", "arm", "other"]
CPU_ISAS: tuple[CpuIsa, ...] = get_args(CpuIsa)
FAKE_CPU_ENV = "REDLINE_CPU"


@dataclass(frozen=True, kw_only=True)
class DeviceFacts:
    """What the resolvers need to know about one device."""

    type: DeviceType
    name: str
    index: int | None = None
    capability: tuple[int, int] | None = None  # CUDA compute capability, (9, 0) for Hopper
    mem_gib: float | None = None
    cpu_count: int = 1
    cpu_isa: CpuIsa = "other"  # of the host CPU, whichever device the facts describe
    cpu_isa_faked: bool = False  # True when REDLINE_CPU set cpu_isa instead of the probe
    rocm_tf32: bool | None = None  # on a ROCm build of torch, whether its fp32 matmuls may run as TF32; None on CUDA

    def __post_init__(self) -> None:
        if self.cpu_isa not in CPU_ISAS:
            raise ConfigError(f"DeviceFacts.cpu_isa={self.cpu_isa!r} is not allowed; expected one of {_allowed_isas()}")

    @property
    def bf16(self) -> bool:
        """Whether the device has bf16 arithmetic: Ampere and newer GPUs, Apple silicon, x86 CPUs
        with AMX or AVX512-BF16 (Arm CPUs with bf16 are not told apart yet).

        Having it does not make bf16 autocast faster: the precision resolver weighs that.
        """
        if self.type == "cuda":
            return self.capability is not None and self.capability >= (8, 0)
        if self.type == "mps":
            return True
        return self.cpu_isa in ("amx", "avx512_bf16")

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


def rocm_tf32() -> bool:
    """Whether a ROCm build of torch runs fp32 matmuls as TF32 when asked: from torch 2.6 on, and only with
    HIPBLASLT_ALLOW_TF32=1 in the environment; without it torch's allow_tf32 is ignored and they run in full fp32
    (aten/src/ATen/Context.cpp, allowTF32CuBLAS; https://github.com/pytorch/pytorch/pull/143549)."""
    allowed = os.environ.get("HIPBLASLT_ALLOW_TF32") == "1"  # c10's check_env: "1" on, "0" off, else ignored
    return allowed and torch.torch_version.TorchVersion(torch.__version__) >= "2.6"


def probe_device(device: torch.device) -> DeviceFacts:
    """Read the facts of ``device``; for CUDA this initialises the CUDA runtime.

    Raises ConfigError when ``REDLINE_CPU`` names no CPU redline knows.
    """
    cpus = usable_cpu_count()
    isa, faked = probe_cpu_isa()
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
            cpu_isa=isa,
            cpu_isa_faked=faked,
            rocm_tf32=rocm_tf32() if torch.version.hip else None,
        )
    if device.type == "mps":
        return DeviceFacts(type="mps", name="Apple MPS", cpu_count=cpus, cpu_isa=isa, cpu_isa_faked=faked)
    return DeviceFacts(type="cpu", name=_cpu_name(), cpu_count=cpus, cpu_isa=isa, cpu_isa_faked=faked)


def probe_cpu_isa() -> tuple[CpuIsa, bool]:
    """Return this CPU's instruction set and whether ``REDLINE_CPU`` faked it.

    ``REDLINE_CPU=amx|avx512_bf16|avx512|avx2|arm|other`` makes a run plan as on that CPU; the maths
    still runs on this one. It exists so that tests and trials can see every CPU's Plan on one
    machine. An unknown value raises ConfigError; the probe itself never fails.
    """
    fake = os.environ.get(FAKE_CPU_ENV, "").strip().lower()
    if fake:
        if fake not in CPU_ISAS:
            raise ConfigError(
                f"{FAKE_CPU_ENV}={os.environ[FAKE_CPU_ENV]!r} is not a CPU redline can plan for; "
                f"expected one of {_allowed_isas()}\n"
                f"hint: unset {FAKE_CPU_ENV} to plan for this machine's CPU, or set it to one of those"
            )
        return cast(CpuIsa, fake), True
    return cpu_isa_of(platform.machine(), _cpu_feature_check()), False


def cpu_isa_of(machine: str, has: Callable[[str], bool]) -> CpuIsa:
    """Classify a CPU from ``platform.machine()`` and a test of Linux /proc/cpuinfo flag names."""
    machine = machine.lower()
    if machine in ("aarch64", "arm64"):
        return "arm"
    if machine not in ("x86_64", "amd64", "x64"):
        return "other"
    for flag, isa in _X86_FEATURES:
        if has(flag):
            return isa
    return "other"


# Best first: an AMX CPU (Sapphire Rapids and later) has AVX512-BF16 and AVX-512 as well, so the
# first flag found names the CPU. Flag names as Linux spells them in /proc/cpuinfo.
_X86_FEATURES: tuple[tuple[str, CpuIsa], ...] = (
    ("amx_tile", "amx"),
    ("avx512_bf16", "avx512_bf16"),
    ("avx512f", "avx512"),
    ("avx2", "avx2"),
)


# torch's own checks (its cpuinfo library, which reads CPUID on every OS); they are private, so each
# falls back to the flags Linux lists in /proc/cpuinfo where this torch lacks it.
_TORCH_CHECKS = {
    "amx_tile": "_is_amx_tile_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "avx512f": "_is_avx512_supported",
    "avx2": "_is_avx2_supported",
}


def _cpu_feature_check() -> Callable[[str], bool]:
    flags = _cpuinfo_flags()

    def has(flag: str) -> bool:
        check = getattr(torch.cpu, _TORCH_CHECKS.get(flag, ""), None)
        if check is None:
            return flag in flags
        try:
            return bool(check())
        except RuntimeError:
            return flag in flags

    return has


def _cpuinfo_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _allowed_isas() -> str:
    return ", ".join(map(repr, CPU_ISAS))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"
