"""What runs with what: driver per CUDA runtime, GPU architecture per wheel, torch per companion.

The tables are data with their source; the functions over them are pure and total: a version that
does not parse gives None, and the check that asked says it could not judge rather than guessing.
"""

from __future__ import annotations

import re
from typing import Literal

Version = tuple[int, ...]

INDEX_URL = "https://download.pytorch.org/whl"

# Minimum driver for each CUDA toolkit's GA release, (Linux x86_64, Windows); None where NVIDIA lists
# none. NVIDIA CUDA Toolkit Release Notes, Table 3 "CUDA Toolkit and Corresponding Driver Versions",
# https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html
MIN_DRIVER: dict[tuple[int, int], tuple[str, str | None]] = {
    (13, 2): ("595.45.04", None),
    (13, 1): ("590.44.01", None),
    (13, 0): ("580.65.06", None),
    (12, 9): ("575.51.03", "576.02"),
    (12, 8): ("570.26", "570.65"),
    (12, 6): ("560.28.03", "560.76"),
    (12, 5): ("555.42.02", "555.85"),
    (12, 4): ("550.54.14", "551.61"),
    (12, 3): ("545.23.06", "545.84"),
    (12, 2): ("535.54.03", "536.25"),
    (12, 1): ("530.30.02", "531.14"),
    (12, 0): ("525.60.13", "527.41"),
    (11, 8): ("520.61.05", "520.06"),
    (11, 7): ("515.43.04", "516.01"),
    (11, 6): ("510.39.01", "511.23"),
    (11, 5): ("495.29.05", "496.04"),
    (11, 4): ("470.42.01", "471.11"),
    (11, 3): ("465.19.01", "465.89"),
    (11, 2): ("460.27.03", "460.82"),
    (11, 1): ("455.23", "456.38"),
    (11, 0): ("450.51.05", "451.48"),
}

# Minor-version compatibility: a CUDA X.y runtime starts on any driver of at least its major's floor,
# with a limited feature set below the Table 3 value (PTX newer than the driver fails to JIT).
# https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html
COMPAT_FLOOR: dict[int, tuple[str, str | None]] = {
    13: ("580.65.06", None),
    12: ("525.60.13", "527.41"),
    11: ("450.80.02", "452.39"),
}
# What a fix says of a wheel it offers in that mode.
MINOR_COMPAT = (
    "minor-version compatibility, where PTX newer than the driver (Triton and torch.compile kernels) fails to load"
)

# Code built for a compute capability runs on the same major with the same or a newer minor, except
# on the Jetson and integrated parts. PyTorch's DEVICE_REQUIREMENT, torch/cuda/__init__.py.
_RUNS_ONLY_ON = {53: {53}, 62: {62}, 72: {72}, 87: {87}, 101: {101, 110}}
_EXCLUDED = {50: {53}, 52: {53}, 60: {62}, 61: {62}, 70: {72}, 80: {87}, 86: {87}, 100: {101}}

# Official wheel channels and the architectures they ship (x86_64), for a torch too old to carry its
# own torch.cuda.PYTORCH_RELEASES_CODE_CC: pytorch/pytorch .ci/manywheel/build_cuda.sh as of torch 2.9,
# with the first torch release published on each channel.
FALLBACK_CHANNELS: dict[str, list[int]] = {
    "12.6": [50, 60, 70, 75, 80, 86, 90],
    "12.8": [70, 75, 80, 86, 90, 100, 120],
    "13.0": [75, 80, 86, 90, 100, 110, 120],
}
FIRST_TORCH_ON_CHANNEL: dict[str, Version] = {"12.6": (2, 6), "12.8": (2, 7), "13.0": (2, 9)}


def parse_version(text: str | None) -> Version | None:
    """Return the leading numeric components: "2.4.0+cu121" -> (2, 4, 0), "570.124.06" -> (570, 124, 6)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", text or "")
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def dotted(version: Version, parts: int = 3) -> str:
    return ".".join(str(part) for part in version[:parts])


def local_tag(version: str | None) -> str | None:
    """Return a wheel's build tag: "2.4.0+cu121" -> "cu121", "2.13.0+cpu" -> "cpu"."""
    _, plus, tag = (version or "").partition("+")
    return tag if plus and tag else None


def tag_cuda(tag: str | None) -> Version | None:
    """Return the CUDA version a build tag names: "cu121" -> (12, 1); None for cpu, rocm or no tag."""
    match = re.fullmatch(r"cu(\d+)(\d)", tag or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def min_driver(cuda: Version, windows: bool = False) -> str | None:
    """Return the driver a CUDA release needs for its full feature set (its Table 3 row, else the nearest older)."""
    rows = [row for row in MIN_DRIVER if row[0] == cuda[0] and row <= cuda[:2]]
    return MIN_DRIVER[max(rows)][1 if windows else 0] if rows else None


def compat_floor(cuda_major: int, windows: bool = False) -> str | None:
    """Return the oldest driver any runtime of this CUDA major starts on."""
    row = COMPAT_FLOOR.get(cuda_major)
    return row[1 if windows else 0] if row else None


def driver_cuda(driver: str | None, windows: bool = False) -> Version | None:
    """Return the newest CUDA (major, minor) whose Table 3 minimum this driver meets."""
    have = parse_version(driver)
    if have is None:
        return None
    met = [
        row for row, mins in MIN_DRIVER.items() if (need := parse_version(mins[1 if windows else 0])) and have >= need
    ]
    return max(met) if met else None


def parse_arch(entry: str) -> tuple[str, int] | None:
    """Read an arch-list entry: "sm_90a" -> ("sm", 90), "compute_120" -> ("compute", 120)."""
    match = re.fullmatch(r"(sm|compute)_(\d+)[af]?", entry.strip())
    return (match.group(1), int(match.group(2))) if match else None


def runs_on(code: int, device: int) -> bool:
    """Whether machine code built for compute capability ``code`` (90 for 9.0) runs on ``device``."""
    if code in _RUNS_ONLY_ON:
        return device in _RUNS_ONLY_ON[code]
    return device // 10 == code // 10 and device >= code and device not in _EXCLUDED.get(code, set())


def arch_support(device: int, arch_list: list[str]) -> Literal["native", "ptx"] | None:
    """Say how a wheel built for ``arch_list`` runs on a GPU: its own kernels, PTX compiled at start-up, or not."""
    entries = [parsed for entry in arch_list if (parsed := parse_arch(entry))]
    if any(kind == "sm" and runs_on(code, device) for kind, code in entries):
        return "native"
    if any(kind == "compute" and code <= device for kind, code in entries):
        return "ptx"
    return None


def is_index_tag(tag: str) -> bool:
    """Whether a version's local tag ("cu128" of "2.7.1+cu128") names a download.pytorch.org index."""
    return re.fullmatch(r"cpu|cu\d+|rocm\d+(\.\d+)*|xpu", tag) is not None


def best_channel(
    capabilities: list[int], max_cuda: Version | None, channels: dict[str, list[int]], *, oldest: bool = False
) -> str | None:
    """Return the newest channel the driver runs (CUDA <= ``max_cuda``) whose kernels run on every GPU; with
    ``oldest``, the oldest such, which needs the least driver upgrade."""
    fits = []
    for cuda, codes in channels.items():
        version = parse_version(cuda)
        if version is None or (max_cuda is not None and version[:2] > max_cuda[:2]):
            continue
        if all(any(runs_on(code, cc) for code in codes) for cc in capabilities):
            fits.append((version, cuda))
    return (min(fits) if oldest else max(fits))[1] if fits else None


def compatible_channel(
    capabilities: list[int], driver: str | None, channels: dict[str, list[int]], windows: bool = False
) -> str | None:
    """Return the oldest channel this driver starts, in full or in minor-version compatibility (the driver at or
    above its CUDA major's COMPAT_FLOOR), whose kernels run on every GPU; the oldest asks the least of the driver."""
    have = parse_version(driver)
    if have is None:
        return None
    fits = []
    for cuda, codes in channels.items():
        version, floor = parse_version(cuda), None
        if version is not None:
            floor = parse_version(compat_floor(version[0], windows))
        if version is None or floor is None or have < floor:
            continue
        if all(any(runs_on(code, cc) for code in codes) for cc in capabilities):
            fits.append((version, cuda))
    return min(fits)[1] if fits else None


def install_torch(torch_version: str | None, channel: str | None, companions: list[str], own_table: bool) -> str:
    """Return the pip command that installs torch and its companions from a CUDA channel (None: the CPU build)."""
    tag = "cpu" if channel is None else "cu" + channel.replace(".", "")
    others = "".join(f" {name}" for name in companions)
    if "dev" in (torch_version or ""):
        return f"pip install --pre --force-reinstall torch{others} --index-url {INDEX_URL}/nightly/{tag}"
    have = parse_version(torch_version)
    first = FIRST_TORCH_ON_CHANNEL.get(channel or "")
    if have is None:
        spec = "torch"
    elif own_table or first is None or have[:2] >= first:
        spec = f"torch=={dotted(have)}"
    else:
        spec = f"'torch>={dotted(first)}'"
    return f"pip install --force-reinstall {spec}{others} --index-url {INDEX_URL}/{tag}"


def companion_version(name: str, torch_version: str | None) -> Version | None:
    """Return the (major, minor) of torchvision or torchaudio built for this torch 2.x.

    pytorch/vision README "Installation": torchvision 0.(m+15) pairs with torch 2.m; torchaudio
    2.m pairs with torch 2.m.
    """
    have = parse_version(torch_version)
    if have is None or len(have) < 2 or have[0] != 2:
        return None
    return (0, have[1] + 15) if name == "torchvision" else (2, have[1]) if name == "torchaudio" else None
