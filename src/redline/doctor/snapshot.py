"""The doctor's snapshot: every fact the probes read about a machine, as plain data.

Probing writes a Snapshot; the checks are pure functions of one. A snapshot saved as JSON
(`redline doctor --save-probe FILE`) is judged on any other machine (`--probe-file FILE`), which is
how a user sends the state of their machine with a bug report. docs/doctor.md documents each field.
Every field has a default, so partial data (the tests') builds; a file read back must hold every top-level
field but those format 1 gained later (``ADDED_LATER``). An unknown field, a value of the wrong type or a
newer ``format_version`` is refused with the path of the offending value.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, cast

from redline.atomic import write_atomic
from redline.errors import ConfigError, few, invalid

FORMAT_VERSION = 1


@dataclass(kw_only=True)
class SystemFacts:
    """The operating system, the CPU and the sandbox the process runs in."""

    os: str = ""  # platform.system(): Linux, Darwin, Windows
    release: str = ""  # kernel or OS release
    machine: str = ""  # x86_64, aarch64, arm64
    mac_version: str | None = None  # "14.5" on macOS
    wsl: bool = False
    container: str | None = None  # docker, podman, kubernetes
    cpu_name: str = ""
    logical_cpus: int = 1
    usable_cpus: int = 1  # the process's affinity mask
    cpu_quota: float | None = None  # cgroup CPU limit in cores; None when unlimited


@dataclass(kw_only=True)
class PythonFacts:
    version: str = ""  # "3.11.7"
    implementation: str = ""  # CPython
    bits: int = 64
    executable: str = ""
    translated: bool = False  # an x86_64 Python running under Rosetta 2 on Apple silicon


@dataclass(kw_only=True)
class ShmFacts:
    path: str = "/dev/shm"
    total_bytes: int = 0
    free_bytes: int = 0


@dataclass(kw_only=True)
class LibraryDir:
    """A directory and the CUDA libraries in it (file names such as ``libcudnn.so.8.9.2``)."""

    path: str
    libs: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class GpuFacts:
    """One NVIDIA GPU as the driver sees it (NVML index order, not CUDA's)."""

    index: int
    name: str
    uuid: str = ""
    capability: tuple[int, int] | None = None
    mem_total_gib: float | None = None
    pci_bus_id: str = ""


@dataclass(kw_only=True)
class DriverFacts:
    """The NVIDIA driver, read through NVML (or `nvidia-smi`) without initialising CUDA."""

    source: Literal["nvml", "nvidia-smi"] | None = None  # None: neither answered
    error: str | None = None  # why NVML (and nvidia-smi) could not answer
    version: str | None = None  # "570.124.06"
    cuda_version: str | None = None  # the newest CUDA the driver runs, "12.8"
    kernel_module_version: str | None = None  # from /proc/driver/nvidia/version
    device_nodes: bool = False  # /dev/nvidia0 (or /dev/dxg on WSL) exists
    gpus: list[GpuFacts] = field(default_factory=list)


@dataclass(kw_only=True)
class AmdFacts:
    """The device files a ROCm build of torch opens: /dev/kfd (AMD's compute driver) and one render node per GPU.

    NVIDIA and Intel GPUs have render nodes too; /dev/kfd is what says an AMD GPU is there for ROCm.
    """

    kfd: bool = False  # /dev/kfd exists
    kfd_access: bool = False  # this process may read and write it
    render_nodes: list[str] = field(default_factory=list)  # /dev/dri/renderD128, ...
    render_access: list[str] = field(default_factory=list)  # those of them this process may read and write


@dataclass(kw_only=True)
class TorchDevice:
    """One CUDA device as torch sees it (CUDA order, after CUDA_VISIBLE_DEVICES)."""

    index: int
    name: str
    capability: tuple[int, int] | None = None
    mem_total_gib: float | None = None
    sm_count: int | None = None
    uuid: str = ""
    arch: str = ""  # ROCm: AMD's target, gcnArchName ("gfx90a:sramecc+:xnack-"); "" under CUDA


@dataclass(kw_only=True)
class TorchFacts:
    """What torch says about itself and the devices, read in a child process (or, --quick, from a file)."""

    # False under --quick: version, cuda and hip were read from torch/version.py without importing
    # torch, and every other field is empty because nothing asked torch.
    imported: bool = True
    import_error: str | None = None
    version: str | None = None  # "2.7.1+cu128"
    cuda: str | None = None  # torch.version.cuda: "12.8"; None for CPU and ROCm builds
    hip: str | None = None  # torch.version.hip
    arch_list: list[str] = field(default_factory=list)  # ["sm_80", "sm_90", "compute_90"]
    release_channels: dict[str, list[int]] | None = None  # torch's own PYTORCH_RELEASES_CODE_CC, this host
    cudnn_version: int | None = None  # torch.backends.cudnn.version(): 90100 for 9.1.0
    cudnn_error: str | None = None
    nccl_version: str | None = None  # "2.21.5"
    num_threads: int | None = None
    mps_built: bool = False
    mps_available: bool = False
    cuda_available: bool | None = None  # None: the child never got that far
    device_count: int | None = None
    devices: list[TorchDevice] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # warnings torch raised while starting CUDA
    cuda_error: str | None = None  # what starting CUDA raised


@dataclass(kw_only=True)
class Measurement:
    """What one device computed: a matmul against a float64 CPU reference, its speed, its copies."""

    device: str  # "cpu", "cuda:0", "mps"
    error: str | None = None  # the exception that stopped the measurement
    max_rel_err: float | None = None  # matmul error relative to the largest reference value
    fp32_tflops: float | None = None
    lowp_tflops: float | None = None  # bf16 (fp16 before Ampere)
    lowp_dtype: str | None = None
    conv_rel_err: float | None = None  # a cuDNN convolution against the CPU
    h2d_pageable_gbps: float | None = None
    h2d_pinned_gbps: float | None = None


@dataclass(kw_only=True)
class ChildRun:
    """How the child process that touched CUDA ended."""

    exit_code: int | None = None  # negative: killed by that signal; None: abandoned after a timeout
    timed_out: bool = False
    timeout_s: float = 0.0
    seconds: float = 0.0
    unfinished_stage: str | None = None  # the stage that began and never ended: where it hung or died
    stderr_tail: str = ""


@dataclass(kw_only=True)
class Snapshot:
    """Every fact the doctor judges; see docs/doctor.md for the meaning of each field."""

    format_version: int = FORMAT_VERSION
    redline_version: str = ""
    taken_at: str = ""  # ISO 8601, UTC
    quick: bool = False  # --quick: no child process, so no measurements and torch read without importing it
    system: SystemFacts = field(default_factory=SystemFacts)
    python: PythonFacts = field(default_factory=PythonFacts)
    env: dict[str, str] = field(default_factory=dict)  # the environment variables the checks read, when set
    packages: dict[str, str] = field(default_factory=dict)  # distribution name -> version
    shm: ShmFacts | None = None  # None where there is no /dev/shm
    library_path: list[LibraryDir] = field(default_factory=list)  # LD_LIBRARY_PATH, in order
    wheel_libs: list[LibraryDir] = field(default_factory=list)  # site-packages/nvidia/*/lib beside torch
    driver: DriverFacts = field(default_factory=DriverFacts)
    amd: AmdFacts | None = None  # None where not probed: not Linux, or a snapshot from before redline read them
    # The RDMA devices in /sys/class/infiniband (InfiniBand or RoCE: mlx5_0, ...), which NCCL's IB transport runs on
    # between nodes; None where not probed, as amd.
    infiniband: list[str] | None = None
    torch: TorchFacts | None = None  # None when the child process never reported importing torch
    measurements: list[Measurement] = field(default_factory=list)
    child: ChildRun | None = None
    probe_errors: dict[str, str] = field(default_factory=dict)  # probe name -> what it raised

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the snapshot as JSON, atomically (as ``check_writable`` checks a path can be)."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"

        def write(tmp: Path) -> None:
            tmp.write_text(text, encoding="utf-8")

        write_atomic(Path(path), write)

    @classmethod
    def from_dict(cls, data: object, source: str = "snapshot") -> Snapshot:
        """Build a Snapshot from parsed JSON, refusing what it cannot trust."""
        version = data.get("format_version") if isinstance(data, dict) else None
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise invalid(
                f"{source}.format_version",
                version,
                f"{FORMAT_VERSION} or lower",
                "the file was written by a newer redline; upgrade redline to read it",
            )
        return load_fields(cls, data, source)


def load_snapshot(path: str | Path, *, name: str = "--probe-file") -> Snapshot:
    """Read a snapshot written by `redline doctor --save-probe`; ``name`` is the argument errors name."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise invalid(name, str(path), "a readable file", str(exc)) from exc
    except ValueError as exc:  # not JSON, or not even UTF-8 text (UnicodeDecodeError)
        raise invalid(
            name, str(path), "a JSON snapshot", f"{exc}; write one with `redline doctor --save-probe FILE`"
        ) from exc
    if isinstance(data, dict) and {"checks", "devices"} <= set(data) and "format_version" not in data:
        raise invalid(  # a slip: the report `--json` prints, saved where the facts it was judged from belong
            name, str(path), "a snapshot written by `redline doctor --save-probe FILE`",
            "this file is the report `redline doctor --json` prints, not the facts it judged; "
            "write those with `redline doctor --save-probe FILE`",
        )  # fmt: skip
    snapshot = Snapshot.from_dict(data, source=f"{path}: snapshot")  # a value of the wrong type is said first
    if missing := [f.name for f in fields(Snapshot) if f.name not in {*cast(dict, data), *ADDED_LATER}]:
        raise ConfigError(  # a file cut down: judged, each check would read what it lacks as unknown
            f"{path}: snapshot lacks the field(s) {few(missing, 4)}, which every snapshot `--save-probe` writes "
            f"holds: judged without them, each check would read them as unknown\nhint: {_NEWER_OR_EDITED}"
        )
    return snapshot


T = TypeVar("T")


def load_fields(cls: type[T], data: object, where: str) -> T:
    """Build dataclass ``cls`` from JSON data, checking each value's type; ``where`` names it in errors."""
    if not isinstance(data, dict):
        raise _wrong(where, data, f"a JSON object ({cls.__name__})")
    assert is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise invalid(f"{where}.{unknown[0]}", data[unknown[0]], f"one of the fields {sorted(names)}", _NEWER_OR_EDITED)
    kwargs = {name: _coerce(hints[name], value, f"{where}.{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise invalid(where, data, f"the fields of {cls.__name__}", str(exc)) from exc


def _coerce(tp: Any, value: object, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]  # only `X | None` unions are used
        return _coerce(inner, value, where)
    if origin is Literal:
        if value not in args:
            raise _wrong(where, value, " or ".join(repr(arg) for arg in args))
        return value
    if origin in (list, tuple, dict):
        return _coerce_container(origin, args, value, where)
    if isinstance(tp, type) and is_dataclass(tp):
        return load_fields(tp, value, where)
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool) and type(value) is tp:
        return value
    raise _wrong(where, value, {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[tp])


def _coerce_container(origin: Any, args: tuple[Any, ...], value: object, where: str) -> Any:
    if origin is list:
        if not isinstance(value, list):
            raise _wrong(where, value, "a list")
        return [_coerce(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise _wrong(where, value, f"a list of {len(args)} values")
        return tuple(_coerce(arg, item, f"{where}[{i}]") for i, (arg, item) in enumerate(zip(args, value, strict=True)))
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise _wrong(where, value, "an object")
    return {key: _coerce(args[1], item, f"{where}.{key}") for key, item in value.items()}


# The snapshot's fields that format 1 gained after its first files were written: a file without them still loads.
ADDED_LATER = frozenset({"amd", "infiniband"})
_NEWER_OR_EDITED = "the file was edited by hand or written by a newer redline; re-create it with `--save-probe`"


def _wrong(where: str, value: object, allowed: str) -> ConfigError:
    return invalid(where, value, allowed, _NEWER_OR_EDITED)
