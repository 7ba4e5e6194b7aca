"""Attention axis: the kernel ``F.scaled_dot_product_attention`` runs.

torch picks one per call, by its own fixed order: on CUDA flash for fp16/bf16 inputs without a mask,
memory-efficient otherwise, math where neither takes the call; cuDNN's kernel only when asked (it
comes after math in torch's order); on a CPU its flash kernel, math where that cannot take the call
(dropout in training). Which is fastest depends on the GPU and the shapes (cuDNN's attention is written
for Hopper), so "auto" keeps torch's pick and `redline tune` times the others on the model's own calls.
A kernel asked for runs every call it can take; the rest fall back to math, which takes any.
"""

from __future__ import annotations

from typing import Literal, get_args

from redline.errors import invalid, one_of
from redline.hardware.device import DeviceFacts
from redline.plan import Choice

AttentionRequest = Literal["auto", "flash", "efficient", "cudnn", "math"]
KERNELS: tuple[str, ...] = get_args(AttentionRequest)[1:]
DEFAULT = "default"  # the Plan's value where torch picks per call
_CPU_KERNELS = ("flash", "math")  # the kernels torch has for a CPU
_AMPERE = (8, 0)  # flash's and cuDNN's attention kernels need an Ampere or newer GPU (sm80)


def resolve_attention(requested: str, facts: DeviceFacts) -> Choice[str]:
    """The kernel ``requested`` ("auto": torch's pick per call), refused where the device has no such kernel."""
    if requested == "auto":
        if facts.type == "cuda":
            return Choice(
                DEFAULT,
                "auto: torch picks per call: flash for fp16/bf16 without a mask, memory-efficient otherwise, "
                "math where neither takes the call",
            )
        if facts.type == "cpu":
            return Choice(DEFAULT, "auto: torch picks per call: its CPU flash kernel, math where that cannot take the "
                          "call (dropout in training)")  # fmt: skip
        return Choice(DEFAULT, f"auto: torch picks per call on {facts.type}")
    check_attention(requested, facts)
    if requested == "math":
        return Choice("math", "requested: math for every call")
    return Choice(requested, f"requested: {requested} for every call it takes, math for the rest")


def plan_kernel(requested: str) -> str:
    """The Plan's value for an attention request: the kernel named, or ``DEFAULT`` where torch picks ("auto")."""
    return DEFAULT if requested == "auto" else requested


def check_attention(requested: str, facts: DeviceFacts) -> None:
    """Refuse an attention kernel this device does not have, naming the ones it does."""
    if requested == "auto":
        return
    if requested not in KERNELS:
        raise one_of("attention", requested, ("auto", *KERNELS))  # with the kernel a mistyped name meant
    if facts.type == "cpu" and requested not in _CPU_KERNELS:
        raise invalid(
            "attention", requested, "'auto', 'flash' or 'math' on a CPU",
            f"on a CPU use attention='flash' or attention='math' (or 'auto'): {requested} is a CUDA kernel",
        )  # fmt: skip
    if facts.type not in ("cpu", "cuda"):
        raise invalid("attention", requested, f"'auto' on {facts.type}", "pass attention='auto': torch picks there")
    if facts.type == "cuda" and requested in ("flash", "cudnn") and (facts.capability or (0, 0)) < _AMPERE:
        major, minor = facts.capability or (0, 0)
        raise invalid(
            "attention", requested, f"'auto', 'efficient' or 'math' on {facts.name} (sm{major}{minor})",
            f"use attention='efficient' (or 'auto'): torch's {requested} attention needs an Ampere or newer GPU (sm80)",
        )  # fmt: skip
