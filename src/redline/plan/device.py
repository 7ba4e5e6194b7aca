"""Device axis: which device a run uses."""

from __future__ import annotations

import re

from redline.errors import DeviceUnavailableError, invalid, nearest
from redline.hardware.device import Accelerators
from redline.plan import Choice

ALLOWED = "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
_PATTERN = re.compile(r"^(auto|cpu|mps|cuda)(?::(\d+))?$")


def check_devices(requested: object) -> tuple[str, str | None]:
    """Check the form of a device request; return its kind and index ("cuda", "1"). Raise ConfigError if malformed."""
    match = _PATTERN.match(requested.strip().lower()) if isinstance(requested, str) else None
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise invalid("devices", requested, ALLOWED, _meant(requested))
    return match.group(1), match.group(2)


def _meant(requested: object) -> str:
    """The hint for a malformed request: torch calls an NVIDIA or AMD GPU 'cuda' ('gpu:1' is 'cuda:1', as is
    'cuda1'); a CPU and Apple's GPU take no index; anything else, the kind it is spelled closest to."""
    text = requested.strip().lower() if isinstance(requested, str) else ""
    gpu = re.match(r"^(?:gpu|cuda|nvidia)[:_-]?(\d*)$", text)
    if gpu:
        meant = "cuda" + (f":{gpu.group(1)}" if gpu.group(1) else "")
    else:
        meant = str(nearest(text.split(":")[0], ("auto", "cpu", "cuda", "mps")) or "")
    return f"did you mean devices={meant!r}?" if meant else "e.g. devices='auto' (a GPU if there is one, else the CPU)"


def resolve_worker_device(requested: str, found: Accelerators, *, local_rank: int | None) -> Choice[str]:
    """Resolve ``requested`` for one process: a worker of a distributed job (``local_rank`` given) gets its own GPU."""
    device = resolve_device(requested, found)
    if local_rank is not None and device.value.startswith("cuda"):  # one GPU per worker
        if local_rank >= found.cuda_count:  # torch would fail later with "invalid device ordinal"
            raise DeviceUnavailableError(
                f"worker with LOCAL_RANK={local_rank} needs its own GPU, but this process sees {found.cuda_count} "
                f"(cuda:0..cuda:{found.cuda_count - 1})\nhint: launch at most {found.cuda_count} processes per "
                "machine (--nproc auto), or train on the CPU (devices='cpu'); check CUDA_VISIBLE_DEVICES"
            )
        return Choice(f"cuda:{local_rank}", f"{device.reason}; worker {local_rank}'s GPU")
    return device


def resolve_device(requested: str, found: Accelerators) -> Choice[str]:
    """Resolve ``requested`` against the accelerators found: "auto" prefers CUDA, then MPS, then CPU."""
    kind, index = check_devices(requested)
    if kind == "auto":
        if found.cuda_count:
            plural = "s" if found.cuda_count > 1 else ""
            return Choice("cuda:0", f"auto: {found.cuda_count} CUDA device{plural} visible")
        if found.mps:
            return Choice("mps", "auto: no CUDA device; Apple MPS available")
        return Choice("cpu", "auto: no CUDA or MPS device visible")
    if kind == "cpu":
        return Choice("cpu", "requested")
    if kind == "mps":
        if not found.mps:
            raise DeviceUnavailableError(
                "devices='mps' was requested but MPS is not available on this machine; allowed here: "
                f"{_available(found)}\nhint: MPS needs Apple silicon and a macOS build of torch; "
                "use devices='auto'"
            )
        return Choice("mps", "requested")
    number = int(index) if index is not None else 0
    if found.cuda_count == 0:
        raise DeviceUnavailableError(
            f"devices={requested!r} was requested but torch sees no CUDA device; allowed here: "
            f"{_available(found)}\nhint: check the driver and that torch is a CUDA build "
            "(`redline doctor` says which), or use devices='auto'"
        )
    if number >= found.cuda_count:
        raise DeviceUnavailableError(
            f"devices={requested!r} was requested but only {found.cuda_count} CUDA device(s) are "
            f"visible (cuda:0..cuda:{found.cuda_count - 1})\nhint: check CUDA_VISIBLE_DEVICES"
        )
    return Choice(f"cuda:{number}", "requested")


def _available(found: Accelerators) -> str:
    names = ["cpu"]
    names += [f"cuda:{i}" for i in range(found.cuda_count)]
    if found.mps:
        names.append("mps")
    return ", ".join(names)
