"""A read-only view of a Snapshot with the facts several checks derive: the build, the GPUs, the right wheel."""

from __future__ import annotations

import os
import re
import signal
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from redline.doctor.compat import (
    FALLBACK_CHANNELS,
    MINOR_COMPAT,
    Version,
    best_channel,
    compatible_channel,
    driver_cuda,
    install_torch,
    min_driver,
    parse_version,
)
from redline.doctor.snapshot import GpuFacts, Snapshot, TorchFacts

DRIVER_DOWNLOAD = "https://www.nvidia.com/Download/index.aspx"
HANG_FIX = (
    "a driver call hung: run `nvidia-smi`; if it hangs too the driver is stuck, so reboot; "
    "otherwise enable persistence mode (`sudo nvidia-smi -pm 1`) and rerun `redline doctor`"
)
# What a check says when it needs a fact only an imported torch gives, and --quick did not import it.
NOT_IMPORTED = "skipped in --quick, which does not import torch: run `redline doctor` for this"
CRASH_FIX = (
    "run `python -c \"import torch; print(torch.zeros(1, device='cuda'))\"` to see the error, "
    "and look for driver errors with `sudo dmesg | grep -i -e xid -e nvrm`"
)

IMPORT_FIX = (
    'run `python -c "import torch"` to see the error: a torch install broken or mixed with another (reinstall it '
    "in a fresh environment), or a sitecustomize or LD_PRELOAD of the environment's"
)
CPU_FIX = (
    'run `python -c "import torch; print((torch.randn(256, 256) @ torch.randn(256, 256)).sum())"` to see the '
    "error: the torch install or the BLAS and OpenMP libraries it loads (check LD_PRELOAD and LD_LIBRARY_PATH)"
)

# torch's settings in the environment whose value, refused, stops torch: the logging ones at `import torch`
# (torch/_logging/_internal.py, _init_logs: an unknown TORCH_LOGS name, a bad format, an unwritable file), the
# allocator's at the first allocation on a GPU (c10/core/AllocatorConfig.cpp; c10/cuda/CUDAAllocatorConfig.cpp
# before it). An error blames one that is set when it names it, quotes its value, or reads as its refusal here.
TORCH_SETTINGS: dict[str, tuple[str, ...]] = {
    "TORCH_LOGS": (),
    "TORCH_LOGS_FORMAT": (r"Invalid format '",),
    "TORCH_LOGS_OUT": (),
    "PYTORCH_CUDA_ALLOC_CONF": (r"allocator config", r"CachingAllocator option"),
    "PYTORCH_ALLOC_CONF": (r"allocator config", r"CachingAllocator option"),
}


@dataclass(frozen=True)
class Machine:
    snap: Snapshot

    @property
    def torch(self) -> TorchFacts | None:
        """torch's facts, or None when torch did not import (torch-build says why)."""
        facts = self.snap.torch
        return None if facts is None or facts.import_error else facts

    @property
    def imported(self) -> bool:
        """torch imported in the child, so the facts only an import gives (devices, kernels, cuDNN) are there."""
        return self.torch is not None and self.torch.imported

    @property
    def build(self) -> Literal["cuda", "rocm", "cpu"] | None:
        facts = self.torch
        if facts is None:
            return None
        return "cuda" if facts.cuda else "rocm" if facts.hip else "cpu"

    @property
    def gpus(self) -> list[GpuFacts]:
        """The NVIDIA GPUs the driver lists, whether or not torch can use them."""
        return self.snap.driver.gpus

    @property
    def apptainer(self) -> bool:
        """An Apptainer (Singularity) container: the host's /dev and user, and GPUs through `--nv` or `--rocm`."""
        return self.snap.system.container == "apptainer"

    def container_gpus(self) -> str:
        """Say how this container is given the NVIDIA GPUs and their driver, in its own runtime's terms."""
        kind = self.snap.system.container
        if kind == "apptainer":  # binds the host's driver libraries only under --nv (apptainer's nvliblist.conf)
            return "run the container with `apptainer exec --nv`"
        if kind == "kubernetes":  # no docker flags in a pod: the NVIDIA device plugin mounts what a GPU request asks
            return "request the GPUs in the pod spec (`resources: limits: nvidia.com/gpu: 1`)"
        return "start the container with `docker run --gpus all` (NVIDIA Container Toolkit)"

    @property
    def linux(self) -> bool:
        return self.snap.system.os == "Linux"

    @property
    def windows(self) -> bool:
        return self.snap.system.os == "Windows"

    @property
    def torch_version(self) -> str | None:
        return (
            self.snap.torch.version if self.snap.torch and self.snap.torch.version else self.snap.packages.get("torch")
        )

    @property
    def capabilities(self) -> list[int]:
        """Compute capabilities of the GPUs (90 for 9.0): the driver's list, else torch's."""
        caps = [gpu.capability for gpu in self.gpus] or [
            d.capability for d in (self.torch.devices if self.torch else [])
        ]
        return [10 * major + minor for major, minor in (cap for cap in caps if cap)]

    @property
    def max_cuda(self) -> Version | None:
        """The newest CUDA the driver runs: what NVML says, else what Table 3 implies."""
        reported = parse_version(self.snap.driver.cuda_version)
        return reported[:2] if reported else driver_cuda(self.snap.driver.version, self.windows)

    @property
    def companions(self) -> list[str]:
        return [name for name in ("torchvision", "torchaudio") if name in self.snap.packages]

    def gpu_summary(self) -> str:
        counts = Counter(gpu.name for gpu in self.gpus)
        return ", ".join(f"{n}x {name}" if n > 1 else name for name, n in counts.items())

    def channels(self) -> tuple[dict[str, list[int]], bool]:
        """Return the wheel channels for this torch and whether they came from torch itself."""
        own = self.snap.torch.release_channels if self.snap.torch else None
        return (own, True) if own else (FALLBACK_CHANNELS, False)

    def install(self, channel: str | None) -> str:
        return install_torch(self.torch_version, channel, self.companions, self.channels()[1])

    def wheel_fix(self) -> str:
        """Return how to get a torch whose kernels run on every GPU and whose CUDA the driver runs."""
        channels, _ = self.channels()
        caps = self.capabilities
        channel = best_channel(caps, self.max_cuda, channels)
        if channel is not None:
            return self.install(channel)
        # the driver runs none: the channel that asks the least of it, whose kernels still run on every GPU
        least = best_channel(caps, None, channels, oldest=True)
        if least is None:
            archs = " ".join(f"sm_{cc}" for cc in sorted(set(caps)))
            return f"no official torch wheel has kernels for {archs}: pick a release that does at https://pytorch.org/get-started/locally/"
        need = min_driver(parse_version(least) or (), self.windows)
        upgrade = f"upgrade the NVIDIA driver to {need} or newer ({DRIVER_DOWNLOAD})"
        if compatible_channel(caps, self.snap.driver.version, {least: channels[least]}, self.windows) is None:
            return f"{upgrade}, then {self.install(least)}"
        return f"{self.install(least)}, {self.in_minor_compat(least)}; to run it in full, {upgrade}"

    def in_minor_compat(self, channel: str) -> str:
        """Say that the driver runs a wheel newer than it only in minor-version compatibility, and what that costs."""
        return f"whose CUDA {channel} the driver ({self.snap.driver.version}) runs only in {MINOR_COMPAT}"

    def child_failure(self) -> str:
        """Describe how the child process that touched CUDA failed: a hang, a crash, or never starting."""
        run = self.snap.child
        if run is None:
            return "did not run: " + self.snap.probe_errors.get("child", "unknown reason")
        where = f" in stage {run.unfinished_stage!r}" if run.unfinished_stage else ""
        if run.timed_out:
            return f"hung for {run.timeout_s:.0f} s{where} and was killed"
        if run.exit_code is not None and run.exit_code < 0:
            return f"was killed by {_signal_name(-run.exit_code)}{where}"
        tail = run.stderr_tail.strip().splitlines()
        return f"exited with code {run.exit_code}{where}" + (f": {tail[-1]}" if tail else "")

    def child_fix(self) -> str:
        """The fix for the child's failure: the driver's, where it stopped in a CUDA stage (or one not known); the
        torch install's, where it stopped importing torch or measuring the CPU, which no driver touches."""
        run = self.snap.child
        stage = run.unfinished_stage if run is not None else None
        if stage == "import":
            return IMPORT_FIX
        if stage in ("cpu", "mps"):
            return CPU_FIX
        return HANG_FIX if run is not None and run.timed_out else CRASH_FIX

    def setting_fix(self, error: str) -> str | None:
        """Return how to fix the torch setting in the environment an error shows torch refused; None for none. An
        out-of-memory error is none: its message names PYTORCH_CUDA_ALLOC_CONF as the setting to try."""
        if mentions(error, r"out of memory"):
            return None
        for name, refusals in TORCH_SETTINGS.items():
            value = self.snap.env.get(name)
            if value is None:
                continue
            named = re.search(rf"\b{name}\b", error) or (value.strip() and f"'{value}'" in error)
            if named or mentions(error, *refusals):
                return f"unset {name}, or give it a value torch accepts: the error is torch refusing {name}={value!r}"
        return None

    def shadowing_dirs(self, error: str) -> list[str]:
        """Return the LD_LIBRARY_PATH entries an import error of torch's may come from: those holding CUDA libraries,
        and any whose library the error names (a libtorch's lib/ handing torch its own libtorch_python.so). Only
        these can hand torch other copies: an NVIDIA container sets /usr/local/nvidia/lib64, which holds the
        driver's libraries and none of torch's."""
        return [
            entry.path
            for entry in self.snap.library_path
            if entry.libs or (entry.path.strip() and f"{entry.path.rstrip('/')}/" in error)
        ]

    def ld_path_without(self, drop: list[str]) -> str:
        """Return the command that removes ``drop`` from LD_LIBRARY_PATH, keeping the other entries."""
        keep = [entry.path for entry in self.snap.library_path if entry.path not in drop]
        return f"export LD_LIBRARY_PATH={os.pathsep.join(keep)}" if keep else "unset LD_LIBRARY_PATH"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def first_line(text: str | None, limit: int = 240) -> str:
    """Return the first line of an error message that says something, shortened; a message that begins with a
    newline (torch's refusal of TORCH_LOGS) leaves its type alone on the first line, so the next one joins it."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    line = lines[0] if lines else ""
    if re.fullmatch(r"[\w.]+:", line) and len(lines) > 1:  # "ValueError:"
        line = f"{line} {lines[1]}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def device_ranges(ids: list[str]) -> str:
    """Shorten device ids: ["cuda:0", "cuda:1", "cuda:2"] -> "cuda:0-2"; anything else is listed."""
    indices = [int(i.removeprefix("cuda:")) for i in ids if re.fullmatch(r"cuda:\d+", i)]
    if len(ids) > 2 and len(indices) == len(ids) and indices == list(range(indices[0], indices[0] + len(ids))):
        return f"cuda:{indices[0]}-{indices[-1]}"
    return ", ".join(ids)


def span(values: list[float]) -> str:
    """Show figures of several devices as one value, or as their range when they differ by more than 1%."""
    low, high = min(values), max(values)
    return f"{high:.3g}" if high <= 1.01 * low else f"{low:.3g}-{high:.3g}"


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def mentions(text: str, *patterns: str) -> bool:
    return any(re.search(pattern, text, re.IGNORECASE) for pattern in patterns)
