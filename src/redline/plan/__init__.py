"""The Plan: every automatic choice of a run, each with the reason it was made.

Each axis (device, precision, compile, memory layout, activation checkpointing, optimizer
implementation, micro-batches, data loading) has one module here with one pure resolver: requested
value and device facts in, a ``Choice`` out.
The Runtime gathers the choices into a frozen ``Plan``; ``Runtime.explain()`` returns it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

from redline.config import one_of

T = TypeVar("T", covariant=True)


@dataclass(frozen=True)
class Choice(Generic[T]):
    """A resolved value and the reason it was chosen."""

    value: T
    reason: str

    def __str__(self) -> str:
        return f"{show_value(self.value)}: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The resolved configuration of a run. Fields still ``None`` were not decided yet."""

    device: Choice[str]
    precision: Choice[str]
    tf32: Choice[bool]
    deterministic: Choice[bool] | None = None
    seed: Choice[int | None] | None = None
    grad_accum: Choice[int]
    micro_batch: Choice[int | str | None] | None = None
    clip_grad_norm: Choice[float | None]
    strategy: Choice[str] | None = None
    channels_last: Choice[bool] | None = None
    compile: Choice[bool] | None = None
    cuda_graphs: Choice[bool] | None = None
    attention: Choice[str] | None = None
    activation_checkpointing: Choice[bool] | None = None
    optimizer: Choice[str] | None = None
    zero_grad: Choice[str] | None = None
    loader: Choice[Any] | None = None

    def rows(self) -> list[tuple[str, str, str]]:
        """Return ``(axis, value, reason)`` for every decided axis, in a stable order."""
        out = []
        for field in fields(self):
            choice = getattr(self, field.name)
            if choice is not None:
                out.append((field.name, show_value(choice.value), choice.reason))
        return out

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Return the plan as JSON-ready data: ``{axis: {"value": ..., "reason": ...}}``."""
        out = {}
        for field in fields(self):
            choice = getattr(self, field.name)
            if choice is not None:
                value = choice.value
                plain = value is None or isinstance(value, bool | int | float | str)
                out[field.name] = {"value": value if plain else str(value), "reason": choice.reason}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> Plan:
        """Read back ``to_dict()``'s data: each axis's value as stored (a loader's settings as their text)."""
        names = {f.name for f in fields(cls)}
        return cls(**{axis: Choice(d["value"], d["reason"]) for axis, d in data.items() if axis in names})

    def __str__(self) -> str:
        rows = self.rows()
        width = max(len(axis) for axis, _, _ in rows)
        value_width = max(len(value) for _, value, _ in rows)
        return "\n".join(f"{axis:<{width}}  {value:<{value_width}}  {reason}" for axis, value, reason in rows)


def parse_switch(name: str, requested: object) -> bool | None:
    """Read an on/off/auto option: ``True``/"on", ``False``/"off", or ``None`` for "auto"."""
    if requested is True or requested is False:
        return requested
    one_of(name, requested, ("auto", "on", "off"))  # else refused, with the switch a yes-or-no word means as hint
    return None if requested == "auto" else requested == "on"


def times(ratio: float) -> str:
    """A measured speed ratio as reasons say it: ``1.42x``; a far slower one keeps two figures (``0.0042x``),
    where two decimals would read ``0.00x``."""
    return f"{ratio:.2f}x" if ratio >= 0.1 or ratio <= 0 else f"{ratio:.2g}x"


def show_value(value: object) -> str:
    """A chosen value as a Plan table shows it: on/off, none, sizes joined by commas."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, tuple | list):
        return ", ".join(map(str, value))
    return str(value)
