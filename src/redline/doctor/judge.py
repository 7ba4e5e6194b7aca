"""Turn a Snapshot into the DoctorReport: the checks, the devices with their figures, the versions."""

from __future__ import annotations

import signal
from typing import Any

from redline.doctor.checks import run_checks
from redline.doctor.checks.libraries import cudnn_text, miopen_text
from redline.doctor.checks.machine import first_line
from redline.doctor.checks.measured import MAX_REL_ERR
from redline.doctor.report import DeviceReport, DoctorReport
from redline.doctor.snapshot import Measurement, Snapshot


def judge(snapshot: Snapshot) -> DoctorReport:
    """Judge a snapshot, taken here or on another machine; a pure function of it."""
    return DoctorReport(checks=run_checks(snapshot), devices=devices(snapshot), versions=versions(snapshot))


def devices(snap: Snapshot) -> list[DeviceReport]:
    """List the CPU, each device torch sees, and each GPU the driver lists that torch does not (or was not asked)."""
    measured = {r.device: r for r in snap.measurements}
    torch = snap.torch if snap.torch and not snap.torch.import_error else None
    found = [DeviceReport(id="cpu", name=snap.system.cpu_name or "CPU", **_figures(measured.get("cpu"), snap, "cpu"))]
    torch_devices = torch.devices if torch and torch.cuda_available else []
    for device in torch_devices:
        label = f"cuda:{device.index}"
        capability = f"{device.capability[0]}.{device.capability[1]}" if device.capability else None
        found.append(
            DeviceReport(
                id=label,
                name=device.name,
                capability=capability,
                arch=device.arch.split(":")[0] or None,  # gfx90a:sramecc+:xnack- -> gfx90a
                mem_gib=_round(device.mem_total_gib),
                **_figures(measured.get(label), snap, label),
            )
        )
    seen = {_uuid(d.uuid) for d in torch_devices}
    usable = None if torch and not torch.imported else False  # --quick never asked torch
    for gpu in snap.driver.gpus:
        if torch_devices and (not gpu.uuid or "" in seen or _uuid(gpu.uuid) in seen):
            continue  # torch sees it (or cannot say which it sees)
        capability = f"{gpu.capability[0]}.{gpu.capability[1]}" if gpu.capability else None
        found.append(
            DeviceReport(
                id=f"gpu:{gpu.index}", name=gpu.name, capability=capability, mem_gib=gpu.mem_total_gib, usable=usable
            )
        )
    if torch and torch.mps_available:
        found.append(DeviceReport(id="mps", name="Apple MPS", **_figures(measured.get("mps"), snap, "mps")))
    return found


def _uuid(text: str) -> str:
    return text.lower().removeprefix("gpu-")


def _round(value: float | None) -> float | None:
    """Keep three significant digits: 0.205 TFLOP/s on a laptop CPU, 721 on an H200."""
    return None if value is None else float(f"{value:.3g}")


def _figures(result: Measurement | None, snap: Snapshot, stage: str) -> dict[str, Any]:
    """A device's measured figures; where the child process died or hung measuring it, ``error`` says so."""
    if result is None:
        run = snap.child
        if run is None or run.unfinished_stage != stage:
            return {}
        how = f"ended with exit code {run.exit_code}"
        if run.timed_out:
            how = f"hung for {run.timeout_s:.0f} s"
        elif run.exit_code is not None and -run.exit_code in set(signal.Signals):
            how = f"was killed by {signal.Signals(-run.exit_code).name}"
        return {"error": f"not measured: the child process measuring it {how}"}
    correct = None if result.error or result.max_rel_err is None else result.max_rel_err <= MAX_REL_ERR
    return {
        "error": first_line(result.error) or None,
        "correct": correct,
        "fp32_tflops": _round(result.fp32_tflops),
        "lowp_tflops": _round(result.lowp_tflops),
        "lowp_dtype": result.lowp_dtype,
        "h2d_pageable_gbps": _round(result.h2d_pageable_gbps),
        "h2d_pinned_gbps": _round(result.h2d_pinned_gbps),
    }


def versions(snap: Snapshot) -> dict[str, str | None]:
    torch = snap.torch
    return {
        "redline": snap.redline_version or None,
        "python": snap.python.version or None,
        "os": f"{snap.system.os} {snap.system.release}".strip() or None,
        "torch": (torch.version if torch else None) or snap.packages.get("torch"),
        "cuda_runtime": torch.cuda if torch else None,
        "hip": torch.hip if torch else None,
        # Under ROCm, torch's cuDNN version is MIOpen's, in an encoding of its own.
        "cudnn": cudnn_text(torch.cudnn_version) if torch and torch.cudnn_version and not torch.hip else None,
        "miopen": miopen_text(torch.cudnn_version) if torch and torch.cudnn_version and torch.hip else None,
        "nccl": torch.nccl_version if torch else None,
        "driver": snap.driver.version,
        "driver_cuda": snap.driver.cuda_version,
        "torchvision": snap.packages.get("torchvision"),
        "torchaudio": snap.packages.get("torchaudio"),
        "triton": snap.packages.get("triton"),
        "nvidia-ml-py": snap.packages.get("nvidia-ml-py"),
    }
