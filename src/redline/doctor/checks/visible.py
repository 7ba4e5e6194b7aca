"""The visible-devices check: does CUDA_VISIBLE_DEVICES name GPUs this machine has?

CUDA reads the list left to right, by index or UUID; at the first entry that names no device it
stops, so "0,2,-1,1" shows GPUs 0 and 2, and the visible GPUs are renumbered cuda:0, cuda:1, ...
(CUDA C++ Programming Guide, "CUDA Environment Variables"). By default CUDA orders devices fastest
first, nvidia-smi by PCI bus; CUDA_DEVICE_ORDER=PCI_BUS_ID makes the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redline.doctor.checks.machine import Machine
from redline.doctor.report import Check, fail, ok, skip, warn
from redline.doctor.snapshot import GpuFacts

HIDE_ALL = ("", "-1", "none", "NoDevFiles")


@dataclass
class VisibleList:
    """What CUDA makes of a CUDA_VISIBLE_DEVICES value."""

    visible: list[str] = field(default_factory=list)  # the entries CUDA accepts, in order
    stopped_at: str | None = None  # the first entry naming no device: CUDA ignores it and all after
    duplicates: list[str] = field(default_factory=list)
    valid: list[str] = field(default_factory=list)  # every entry naming a device, wherever it stands


def read_visible(value: str, gpus: list[GpuFacts]) -> VisibleList:
    """Parse a CUDA_VISIBLE_DEVICES value against the GPUs the driver lists."""
    result = VisibleList()
    for entry in (part.strip() for part in value.split(",")):
        gpu = _match(entry, gpus)
        if gpu is None:
            if result.stopped_at is None:
                result.stopped_at = entry
            continue
        if gpu in result.valid:
            result.duplicates.append(entry)
            continue
        result.valid.append(gpu)
        if result.stopped_at is None:
            result.visible.append(gpu)
    return result


def hides_every_gpu(value: str, gpus: list[GpuFacts]) -> bool:
    """Whether a CUDA_VISIBLE_DEVICES value leaves CUDA no GPU of those the driver lists (a value that hides all
    whatever the GPUs are, or a list whose first entry names none of them)."""
    if value.strip() in HIDE_ALL:
        return True
    return bool(gpus) and not read_visible(value, gpus).visible


def _match(entry: str, gpus: list[GpuFacts]) -> str | None:
    """Return the GPU an entry names, as its NVML index (or a MIG UUID, which NVML's GPU list cannot check)."""
    if entry.isascii() and entry.isdigit():
        return entry if int(entry) < len(gpus) else None
    if entry.startswith("MIG-"):
        return entry
    if entry.startswith("GPU-"):
        named = [gpu for gpu in gpus if gpu.uuid.lower().startswith(entry.lower())]
        return str(named[0].index) if len(named) == 1 else None
    return None


def visible_devices(m: Machine) -> Check:
    value, gpus = m.snap.env.get("CUDA_VISIBLE_DEVICES"), m.gpus
    if not gpus:
        shown = "unset" if value is None else f"{value!r}"
        return skip("visible-devices", f"no NVIDIA GPU to check CUDA_VISIBLE_DEVICES ({shown}) against")
    every = ",".join(str(gpu.index) for gpu in gpus)
    if value is None:
        if _mixed_without_pci_order(m):
            return warn(
                "visible-devices",
                f"unset: all {len(gpus)} GPUs visible; they are of mixed models, "
                "which CUDA numbers fastest first, not in nvidia-smi's order",
                "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
            )
        return ok(
            "visible-devices", "unset: the GPU is visible" if len(gpus) == 1 else f"unset: all {len(gpus)} GPUs visible"
        )
    shown = f"CUDA_VISIBLE_DEVICES={value!r}"
    if value.strip() in HIDE_ALL:
        return warn(
            "visible-devices",
            f"{shown} hides {_the_gpus(gpus)}",
            f"unset CUDA_VISIBLE_DEVICES (or list GPUs: {every})",
        )
    parsed = read_visible(value, gpus)
    if parsed.stopped_at == "" and parsed.visible and parsed.visible == parsed.valid:  # "0,1,": a stray comma
        return warn(
            "visible-devices",
            f"{shown} has an empty entry, where CUDA stops reading: it sees {', '.join(parsed.visible)}, every GPU "
            "listed, but an entry added after it would be lost",
            f"export CUDA_VISIBLE_DEVICES={','.join(parsed.valid)}",
        )
    if parsed.stopped_at is not None:
        seen = f"CUDA sees only {', '.join(parsed.visible)}" if parsed.visible else "CUDA sees no GPU"
        named = "is not the GPU (0)" if len(gpus) == 1 else f"names none of the {len(gpus)} GPUs (0-{len(gpus) - 1})"
        detail = f"{shown}: {parsed.stopped_at!r} {named}, so {seen}"
        if parsed.valid:
            fix = f"export CUDA_VISIBLE_DEVICES={','.join(parsed.valid)}"
        else:
            fix = f"unset CUDA_VISIBLE_DEVICES (or name GPUs among {every})"
        return fail("visible-devices", detail, fix)
    if parsed.duplicates:
        return warn(
            "visible-devices",
            f"{shown} lists {', '.join(parsed.duplicates)} twice",
            f"export CUDA_VISIBLE_DEVICES={','.join(parsed.valid)}",
        )
    torch = m.torch
    count = torch.device_count if torch is not None and torch.cuda_available else None
    mig = any(entry.startswith("MIG-") for entry in parsed.visible)
    if count is not None and count != len(parsed.visible) and not mig:
        return warn(
            "visible-devices",
            f"{shown} names {len(parsed.visible)} GPU(s) but torch sees {count}",
            "compare `nvidia-smi -L` with the list, and set CUDA_VISIBLE_DEVICES before Python starts",
        )
    renumbered = ", ".join(f"GPU {gpu} as cuda:{i}" for i, gpu in enumerate(parsed.visible))
    by_index = any(entry.strip().isdigit() for entry in value.split(","))
    if by_index and _mixed_without_pci_order(m):
        return warn(
            "visible-devices",
            f"{shown} names GPUs by index on mixed models, which CUDA numbers fastest first, not in "
            f"nvidia-smi's order, so the GPUs it selects may not be {', '.join(parsed.visible)}",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
        )
    return ok("visible-devices", f"{shown}: {renumbered}")


def _the_gpus(gpus: list[GpuFacts]) -> str:
    return "the GPU" if len(gpus) == 1 else f"all {len(gpus)} GPUs"


def _mixed_without_pci_order(m: Machine) -> bool:
    return len({gpu.name for gpu in m.gpus}) > 1 and m.snap.env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
