"""The doctor's checks: pure functions of a Snapshot, one per id, in the order the report lists them."""

from __future__ import annotations

from collections.abc import Callable

from redline.doctor.checks import cuda, host, libraries, measured, rocm, visible
from redline.doctor.checks.machine import Machine
from redline.doctor.report import Check, fail, warn
from redline.doctor.snapshot import Snapshot

CHECKS: dict[str, Callable[[Machine], Check]] = {
    "python": host.python,
    "nvidia-driver": cuda.nvidia_driver,
    "rocm-devices": rocm.rocm_devices,
    "torch-build": cuda.torch_build,
    "cuda-available": cuda.cuda_available,
    "driver-runtime-compat": cuda.driver_runtime_compat,
    "gpu-arch-supported": cuda.gpu_arch_supported,
    "visible-devices": visible.visible_devices,
    "cudnn": libraries.cudnn,
    "nccl": libraries.nccl,
    "shm-size": host.shm_size,
    "library-shadowing": libraries.library_shadowing,
    "torch-companions": libraries.torch_companions,
    "cpu-threads": host.cpu_threads,
    "mps": host.mps,
    "device-smoke": measured.device_smoke,
    "h2d-bandwidth": measured.h2d_bandwidth,
}

BUG_REPORT_FIX = "report this redline bug with the snapshot from `redline doctor --save-probe snapshot.json`"
# The check that judges each probe's facts alone. A probe that raised left its facts at their defaults
# (no driver, no /dev/shm, no packages), which that check would report as this machine's.
JUDGES_PROBE = {
    "python": "python",
    "driver": "nvidia-driver",
    "amd": "rocm-devices",
    "shm": "shm-size",
    "library_path": "library-shadowing",
    "wheel_libs": "library-shadowing",
    "packages": "torch-companions",
}


def run_checks(snapshot: Snapshot, checks: dict[str, Callable[[Machine], Check]] = CHECKS) -> list[Check]:
    """Judge the snapshot with every check; a check that raises becomes a failed check, never a crash."""
    machine = Machine(snapshot)
    results = []
    for check_id, check in checks.items():
        try:
            result = check(machine)
            if result.id != check_id:
                raise ValueError(f"returned the verdict of {result.id!r}")
        except Exception as exc:  # the doctor must never crash on an odd snapshot
            result = fail(check_id, f"redline could not judge this: {type(exc).__name__}: {exc}", BUG_REPORT_FIX)
        results.append(_unless_unprobed(snapshot, result))
    return results


def _unless_unprobed(snapshot: Snapshot, result: Check) -> Check:
    """``result``, or a warning that it could not be checked where the probe of its facts raised."""
    failed = [
        f"{probe}: {error}" for probe, error in snapshot.probe_errors.items() if JUDGES_PROBE.get(probe) == result.id
    ]
    if not failed:
        return result
    return warn(result.id, f"not checked: probing it failed ({'; '.join(failed)})", BUG_REPORT_FIX)
