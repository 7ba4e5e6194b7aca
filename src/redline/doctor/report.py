"""The doctor's result: the checks with their verdicts, the devices with their figures, the versions."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(frozen=True, kw_only=True)
class Check:
    """One verdict: ``fix`` is a command or a concrete step, present for every warn and fail."""

    id: str
    status: Status
    detail: str
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.status in ("warn", "fail") and not self.fix:
            raise ValueError(f"check {self.id!r} is {self.status} without a fix")


def ok(id: str, detail: str) -> Check:
    return Check(id=id, status="ok", detail=detail)


def skip(id: str, reason: str) -> Check:
    return Check(id=id, status="skip", detail=reason)


def warn(id: str, detail: str, fix: str) -> Check:
    return Check(id=id, status="warn", detail=detail, fix=fix)


def fail(id: str, detail: str, fix: str) -> Check:
    return Check(id=id, status="fail", detail=detail, fix=fix)


@dataclass(frozen=True, kw_only=True)
class DeviceReport:
    """A device torch can use (or a GPU the driver sees that torch cannot), with what was measured on it."""

    id: str  # "cpu", "cuda:0", "mps", or "gpu:3" for a GPU torch does not see
    name: str
    capability: str | None = None  # "9.0"
    arch: str | None = None  # ROCm: AMD's target ("gfx942"), shown in place of the capability
    mem_gib: float | None = None
    usable: bool | None = True  # torch sees it; False: only the driver lists it; None: --quick did not ask torch
    error: str | None = None  # what stopped its measurement (device-smoke has the fix)
    correct: bool | None = None  # the matmul matched the float64 reference; None: not measured
    fp32_tflops: float | None = None
    lowp_tflops: float | None = None
    lowp_dtype: str | None = None
    h2d_pageable_gbps: float | None = None
    h2d_pinned_gbps: float | None = None


@dataclass(frozen=True, kw_only=True)
class DoctorReport:
    """What `redline doctor` found; ``exit_code`` is 1 when any check failed."""

    checks: list[Check]
    devices: list[DeviceReport] = field(default_factory=list)
    versions: dict[str, str | None] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 1 if any(check.status == "fail" for check in self.checks) else 0

    def check(self, id: str) -> Check:
        """Return the check with this id."""
        for check in self.checks:
            if check.id == id:
                return check
        raise KeyError(id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "checks": [asdict(check) for check in self.checks],
            "devices": [asdict(device) for device in self.devices],
            "versions": dict(self.versions),
        }
