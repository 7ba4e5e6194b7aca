"""Which configurations a bench measures: the naive loop, the matrix the user asked for, and auto.

Every device gets a **naive** row, the loop a tutorial writes (eager fp32, ``.to(device)``, a
plain DataLoader), which every speed-up is measured against, and an **auto** row, what
``redline train`` would run there (a cached tuned Plan; without one, precision measured by a
trial, the rest by rule). Between them lies the matrix of explicit settings: devices x
precisions x compile x batch sizes, each run through the Runtime.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from redline.errors import ConfigError, invalid, nearest
from redline.hardware.device import DeviceFacts
from redline.plan.precision import PRECISIONS, fast_precisions

Kind = Literal["naive", "explicit", "auto"]
T = TypeVar("T")


@dataclass(frozen=True)
class Setting:
    """One row of a bench: how the training step runs."""

    kind: Kind
    device: str  # "cpu", "cuda", "cuda:1", "mps"
    precision: str  # "fp32", "bf16-mixed", "fp16-mixed", or "auto"
    compile: bool | None  # None: auto
    batch_size: int
    # The auto row of a device the user left to auto ("auto" then, else ""): its run is given devices="auto" where
    # auto picks this device, so its Plan says why, as train's does (loops.py row_options), not "requested"
    asked: str = field(default="", compare=False)

    @property
    def name(self) -> str:
        """A short unique label: ``naive cpu fp32 b64``, ``cpu bf16-mixed compiled b64``, ``auto cpu b64``."""
        size = f"b{self.batch_size}"
        if self.kind == "naive":
            return f"naive {self.device} fp32 {size}"
        if self.kind == "auto":
            return f"auto {self.device} {size}"
        return f"{self.device} {self.precision} {'compiled' if self.compile else 'eager'} {size}"


def listed(name: str, given: Iterable[T], example: str) -> list[T]:
    """Return ``given`` as a list; a lone string or number, a slip for a list of one, is a ConfigError."""
    if isinstance(given, str | int | float):  # a string would be read letter by letter; bool is an int
        raise invalid(name, given, "a list", f"e.g. {name}={example}")
    items = list(given)
    if not items:  # the command line refuses an empty --precision too; None (the default) is how to ask for it
        raise invalid(name, items, "a list of one or more", f"e.g. {name}={example}, or leave it out for the default")
    return items


def expand(
    devices: Sequence[DeviceFacts],
    *,
    precisions: Sequence[str] | None,
    compiles: Sequence[bool],
    batch_sizes: Sequence[int],
    auto: bool = True,
    asked: str = "",
) -> list[Setting]:
    """The rows to measure, per batch size and device: naive first, then the matrix, then auto.

    ``precisions`` None gives fp32 and whichever reduced precision the device has fast arithmetic
    for (``fast_precisions``), the candidates auto's own trial weighs. ``asked`` "auto": the devices were left to
    auto (``Setting.asked``).
    """
    if not devices:
        raise ConfigError("no device to bench\nhint: pass --devices cpu (or cuda, mps)")
    for name in precisions or ():
        if name not in PRECISIONS:
            near = nearest(name, PRECISIONS)
            hint = f"did you mean {near}?" if near else "e.g. --precision fp32,bf16-mixed"
            if name == "auto":
                hint = f"auto's choice is the auto row's, benched unless --no-auto; list fixed ones, {hint}"
            raise ConfigError(f"precision {name!r} is not one of {', '.join(PRECISIONS)}\nhint: {hint}")
    if any(not isinstance(flag, bool) for flag in compiles):  # "off" is truthy: it would compile
        allowed = "a list of True (compiled) and False (eager)"
        raise invalid("compiles", compiles, allowed, "e.g. compiles=[False, True]")
    for size in batch_sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise invalid("batch_sizes", batch_sizes, "positive integers", "e.g. batch_sizes=[32, 64]")
    rows: list[Setting] = []
    for size in dict.fromkeys(batch_sizes):
        for facts in devices:
            device = facts.label
            chosen = list(precisions) if precisions else ["fp32", *fast_precisions(facts)]
            rows.append(Setting("naive", device, "fp32", False, size))
            rows += [
                Setting("explicit", device, name, flag, size)
                for name in dict.fromkeys(chosen)
                for flag in dict.fromkeys(compiles)
            ]
            if auto:
                rows.append(Setting("auto", device, "auto", None, size, asked=asked))
    return rows
