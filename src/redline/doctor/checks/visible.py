"""The visible-devices check: does CUDA_VISIBLE_DEVICES name GPUs this machine has?

CUDA reads the list left to right; at the first entry that names no device it stops, so "0,2,-1,1"
shows GPUs 0 and 2, and the visible GPUs are renumbered cuda:0, cuda:1, ... (CUDA C++ Programming
Guide, "CUDA Environment Variables"). The finer rules are those torch's _parse_visible_devices and
_transform_uuid_to_ordinals (torch/cuda/__init__.py) keep to agree with CUDA: a list is of one kind,
indices or UUIDs ("GPU-", "MIG-"), as its first entry is; an index entry is read as strtoul reads it,
its leading number ("1gpu" is 1, "+1" is 1); and a GPU listed twice hides every GPU. By default CUDA
orders devices fastest first, nvidia-smi by PCI bus; CUDA_DEVICE_ORDER=PCI_BUS_ID makes the two agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from redline.doctor.checks.machine import Machine
from redline.doctor.report import Check, fail, ok, skip, warn
from redline.doctor.snapshot import GpuFacts

HIDE_ALL = ("", "-1", "none", "NoDevFiles")
UUID_KINDS = ("GPU-", "MIG-")


@dataclass
class VisibleList:
    """What CUDA makes of a CUDA_VISIBLE_DEVICES value."""

    kind: str | None = None  # "GPU-" or "MIG-" for a list of UUIDs, None for one of indices
    read: list[str] = field(default_factory=list)  # what CUDA reads, before it looks for the GPUs: "1gpu" as "1"
    visible: list[str] = field(default_factory=list)  # the GPUs CUDA shows, in order: NVML indices, or MIG UUIDs
    stopped_at: str | None = None  # the first entry naming no device: CUDA ignores it and all after
    repeated: str | None = None  # an entry naming a GPU named before it, which leaves CUDA no GPU at all
    valid: list[str] = field(default_factory=list)  # each GPU an entry names, wherever it stands, as export spells it
    read_as: dict[str, str] = field(default_factory=dict)  # the index entries CUDA reads otherwise: "1gpu" as "1"


def leading_index(entry: str) -> int | None:
    """Read an index entry as CUDA does, by its leading number (strtoul): "1gpu" -> 1, "+1" -> 1; None for none."""
    match = re.match(r"[+-]?[0-9]+", entry.strip())
    number = int(match.group()) if match else -1
    return number if number >= 0 else None


def read_visible(value: str, gpus: list[GpuFacts]) -> VisibleList:
    """Parse a CUDA_VISIBLE_DEVICES value against the GPUs the driver lists (see the module's docstring).

    As torch does: the entries are read up to the first not of the list's kind, and one read twice leaves no GPU;
    then they are matched to GPUs up to the first that names none (an index past the last GPU, a UUID prefix of
    no GPU or of several), and two naming the same GPU leave none.
    """
    kind = next((prefix for prefix in UUID_KINDS if value.startswith(prefix)), None)
    result = VisibleList(kind=kind)
    entries = value.split(",") if kind else [entry.strip() for entry in value.split(",")]
    read: list[tuple[str, str]] = []  # (entry, what CUDA reads in it)
    for entry in entries:
        key = _read(entry, kind)
        if key is None:
            result.stopped_at = entry
            break
        if key in (seen for _, seen in read):
            result.repeated = entry
            break
        read.append((entry, key))
    for entry, key in read if result.repeated is None else []:
        gpu = _gpu_named(key, kind, gpus)
        if gpu is None:
            result.stopped_at = entry
            break
        if gpu in result.visible:
            result.repeated = entry
            break
        result.visible.append(gpu)
    if result.repeated is not None:
        result.visible = []
    result.read = [key for _, key in read]
    result.read_as = {entry: key for entry, key in read if kind is None and entry != key}
    named: list[str] = []
    for entry in entries:  # each GPU an entry names, for the export line that keeps them all
        gpu, spelled = _spelled(entry, kind, gpus)
        if gpu is not None and gpu not in named:
            named.append(gpu)
            result.valid.append(spelled)
    return result


def _read(entry: str, kind: str | None) -> str | None:
    """Return what CUDA reads in an entry of a list of this kind (an index as text, a UUID prefix); None: nothing."""
    if kind is not None:
        return entry if entry.startswith(kind) else None
    index = leading_index(entry)
    return None if index is None else str(index)


def _gpu_named(key: str, kind: str | None, gpus: list[GpuFacts]) -> str | None:
    """Return the GPU a read entry names: its NVML index, or a MIG UUID, which NVML's GPU list cannot check."""
    if kind is None:
        return key if int(key) < len(gpus) else None
    if kind == "MIG-":
        return key
    named = [gpu for gpu in gpus if gpu.uuid.startswith(key)]  # a prefix of two GPUs names neither
    return str(named[0].index) if len(named) == 1 else None


def _spelled(entry: str, kind: str | None, gpus: list[GpuFacts]) -> tuple[str | None, str]:
    """Return the GPU an entry names, read as whichever kind it is, and how a list of ``kind`` spells it; a MIG
    entry names a device only in a list of MIG UUIDs, and that list nothing else."""
    stripped = entry.strip()
    if (kind == "MIG-") != stripped.startswith("MIG-"):
        return None, ""
    if kind == "MIG-":
        return stripped, stripped
    uuid = stripped.startswith("GPU-")
    key = stripped if uuid else _read(stripped, None)
    gpu = _gpu_named(key, "GPU-" if uuid else None, gpus) if key is not None else None
    if gpu is None:
        return None, ""
    if kind is None:
        return gpu, gpu
    return gpu, stripped if uuid else gpus[int(gpu)].uuid


def hides_every_gpu(value: str, gpus: list[GpuFacts]) -> bool:
    """Whether a CUDA_VISIBLE_DEVICES value leaves CUDA no GPU: one that hides all whatever the GPUs are (a first
    entry CUDA cannot read, as "-1", or a repeated one), or a list whose first entry names none of those listed."""
    parsed = read_visible(value, gpus)
    return parsed.repeated is not None or not parsed.read or (bool(gpus) and not parsed.visible)


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
    export = f"export CUDA_VISIBLE_DEVICES={','.join(parsed.valid)}"
    if parsed.repeated is not None:
        detail = f"{shown}: {parsed.repeated!r} repeats an earlier entry, and a list with a repeat hides every GPU"
        return fail("visible-devices", f"{detail}, so CUDA sees no GPU", export)
    if parsed.stopped_at == "" and parsed.visible and len(parsed.visible) == len(parsed.valid):  # "0,1,"
        return warn(
            "visible-devices",
            f"{shown} has an empty entry, where CUDA stops reading: it sees {', '.join(parsed.visible)}, every GPU "
            "listed, but an entry added after it would be lost",
            export,
        )
    if parsed.stopped_at is not None:
        seen = f"CUDA sees only {', '.join(parsed.visible)}" if parsed.visible else "CUDA sees no GPU"
        detail = f"{shown}: {parsed.stopped_at!r} {_why_stopped(parsed, gpus)}, so {seen}"
        fix = export if parsed.valid else f"unset CUDA_VISIBLE_DEVICES (or name GPUs among {every})"
        return fail("visible-devices", detail, fix)
    if parsed.read_as:  # "1gpu": CUDA takes the leading number, as strtoul does
        shown += f" (CUDA reads {', '.join(f'{entry!r} as {key}' for entry, key in parsed.read_as.items())})"
    torch = m.torch
    count = torch.device_count if torch is not None and torch.cuda_available else None
    if count is not None and count != len(parsed.visible) and parsed.kind != "MIG-":
        return warn(
            "visible-devices",
            f"{shown} names {len(parsed.visible)} GPU(s) but torch sees {count}",
            "compare `nvidia-smi -L` with the list, and set CUDA_VISIBLE_DEVICES before Python starts",
        )
    renumbered = ", ".join(f"GPU {gpu} as cuda:{i}" for i, gpu in enumerate(parsed.visible))
    if parsed.kind is None and _mixed_without_pci_order(m):
        return warn(
            "visible-devices",
            f"{shown} names GPUs by index on mixed models, which CUDA numbers fastest first, not in "
            f"nvidia-smi's order, so the GPUs it selects may not be {', '.join(parsed.visible)}",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
        )
    return ok("visible-devices", f"{shown}: {renumbered}")


def _why_stopped(parsed: VisibleList, gpus: list[GpuFacts]) -> str:
    """Say why the entry CUDA stopped at names no device: none of the GPUs, or one in the other kind of list."""
    entry = parsed.stopped_at or ""
    if _spelled(entry, parsed.kind, gpus)[0] is not None:
        kinds = ("a UUID", "indices") if parsed.kind is None else ("an index", "UUIDs")
        return (
            f"names a GPU, but as {kinds[0]} in a list of {kinds[1]}, and CUDA reads a list as its first entry's kind"
        )
    return "is not the GPU (0)" if len(gpus) == 1 else f"names none of the {len(gpus)} GPUs (0-{len(gpus) - 1})"


def _the_gpus(gpus: list[GpuFacts]) -> str:
    return "the GPU" if len(gpus) == 1 else f"all {len(gpus)} GPUs"


def _mixed_without_pci_order(m: Machine) -> bool:
    return len({gpu.name for gpu in m.gpus}) > 1 and m.snap.env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
