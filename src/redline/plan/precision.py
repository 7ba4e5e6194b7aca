"""Precision axis: fp32, bf16 or fp16 mixed precision, and TF32 matmuls."""

from __future__ import annotations

from typing import Literal, cast, get_args

from redline.errors import ConfigError, invalid
from redline.hardware.device import DeviceFacts
from redline.plan import Choice

PrecisionName = Literal["fp32", "bf16-mixed", "fp16-mixed"]
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)


def resolve_precision(requested: str, facts: DeviceFacts) -> Choice[PrecisionName]:
    """Resolve "auto" to bf16 where the device runs it natively, fp16 on older GPUs, else fp32."""
    if requested not in (*PRECISIONS, "auto"):
        raise invalid("precision", requested, f"'auto' or one of {', '.join(map(repr, PRECISIONS))}")
    if requested == "auto":
        return _auto(facts)
    if requested == "bf16-mixed" and facts.type == "cuda" and not facts.bf16:
        cc = ".".join(map(str, facts.capability or (0, 0)))
        raise ConfigError(
            f"precision='bf16-mixed' was requested but {facts.name} (compute capability {cc}) has no "
            "native bf16; allowed on this device: 'fp32', 'fp16-mixed'\n"
            "hint: use precision='fp16-mixed' (loss scaling is handled) or 'auto'"
        )
    return Choice(cast(PrecisionName, requested), "requested")


def _auto(facts: DeviceFacts) -> Choice[PrecisionName]:
    if facts.type == "cuda":
        cc = "".join(map(str, facts.capability or (0, 0)))
        if facts.bf16:
            return Choice("bf16-mixed", f"auto: {facts.name} runs bf16 natively (sm{cc})")
        if facts.tensor_cores:
            return Choice("fp16-mixed", f"auto: {facts.name} (sm{cc}) has fp16 tensor cores but no bf16")
        return Choice("fp32", f"auto: {facts.name} (sm{cc}) has no tensor cores; mixed precision gains little")
    if facts.type == "mps":
        return Choice("fp32", "auto: mixed precision on MPS is not reliably faster; fp32 kept")
    if facts.cpu_fast_bf16:
        # Even with AMX, a small model can lose to autocast's casts; the loop must never be slower.
        return Choice("fp32", "auto: CPU has AMX bf16, but autocast's casts often cost more than they save")
    # Measured on a 2-core AVX2 machine: bf16 autocast ran the digits CNN about 30x slower than fp32.
    return Choice("fp32", "auto: this CPU has no fast bf16 (no AMX); bf16 autocast would be slower")


def resolve_tf32(facts: DeviceFacts) -> Choice[bool]:
    """Turn on TF32 matmuls and convolutions on Ampere and newer GPUs.

    TF32 keeps fp32's range with a 10-bit mantissa; PyTorch documents its accuracy trade-off at
    https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices
    """
    if facts.type != "cuda":
        return Choice(False, f"not available on {facts.type}")
    if facts.capability is None or facts.capability < (8, 0):
        return Choice(False, f"{facts.name} predates Ampere; no TF32 units")
    return Choice(True, f"{facts.name} has TF32 tensor cores; fp32 matmuls run on them")
