"""Precision axis: fp32, bf16 or fp16 mixed precision, and TF32 matmuls."""

from __future__ import annotations

from typing import Literal, cast, get_args

from redline.errors import invalid, one_of
from redline.hardware.device import FAKE_CPU_ENV, CpuIsa, DeviceFacts
from redline.plan import Choice

PrecisionName = Literal["fp32", "bf16-mixed", "fp16-mixed"]
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)


def check_precision(requested: str) -> None:
    """Refuse a precision no run takes ("auto" or one of PRECISIONS), whatever the device."""
    if requested not in (*PRECISIONS, "auto"):
        raise one_of("precision", requested, ("auto", *PRECISIONS))


def resolve_precision(requested: str, facts: DeviceFacts) -> Choice[PrecisionName]:
    """Resolve "auto" to bf16 where the device runs it natively, fp16 on older GPUs, else fp32.

    On a CPU "auto" is fp32 whatever its instruction set; the reason names the set it saw.
    """
    check_precision(requested)
    if requested == "auto":
        return _auto(facts)
    if requested == "bf16-mixed" and facts.type == "cuda" and not facts.bf16:
        cc = ".".join(map(str, facts.capability or (0, 0)))
        allowed = f"'fp32', 'fp16-mixed' or 'auto' on {facts.name}, which has no native bf16 (compute capability {cc})"
        raise invalid("precision", requested, allowed, "use precision='fp16-mixed' (loss scaling is handled) or 'auto'")
    if requested == "fp16-mixed" and facts.type == "cpu":
        return Choice(
            "fp16-mixed",
            "requested; on a CPU fp16 needs loss scaling (a step whose gradients overflow is skipped, and counted "
            "in the summary) and has fast kernels only with AMX-FP16: bf16-mixed needs no scaling",
        )
    return Choice(cast(PrecisionName, requested), "requested")


def _auto(facts: DeviceFacts) -> Choice[PrecisionName]:
    if facts.type == "cuda":
        major, minor = facts.capability or (0, 0)
        # a ROCm build reports an AMD card's gfx architecture as its capability (gfx942 as 9.4), not an sm
        cc = f"ROCm capability {major}.{minor}" if facts.name.startswith("AMD") else f"sm{major}{minor}"
        if facts.bf16:
            return Choice("bf16-mixed", f"auto: {facts.name} runs bf16 natively ({cc})")
        if facts.tensor_cores:
            return Choice("fp16-mixed", f"auto: {facts.name} ({cc}) has fp16 tensor cores but no bf16")
        return Choice("fp32", f"auto: {facts.name} ({cc}) has no tensor cores; mixed precision gains little")
    if facts.type == "mps":
        return Choice("fp32", "auto: mixed precision on MPS is not reliably faster; fp32 kept")
    # fp32 on every CPU until a trial measures bf16 on the user's own model: a rule cannot rank them.
    reason = f"auto: {_CPU_REASONS[facts.cpu_isa]}"
    if facts.cpu_isa_faked:
        reason += f" ({FAKE_CPU_ENV}={facts.cpu_isa}: planned as that CPU, not this machine's)"
    return Choice("fp32", reason)


# What bf16 autocast does on each kind of CPU, as far as it was measured.
_CPU_REASONS: dict[CpuIsa, str] = {
    # Measured on a 2-core Sapphire Rapids (AMX), torch 2.13, `redline train --compile off`:
    # the digits CNN ran 1.14-1.25x fp32 in bf16-mixed, chargpt 0.91x.
    "amx": "CPU has AMX bf16, but autocast's casts can cost more than they save (a small GPT ran 0.91x fp32)",
    # Not yet in benchmarks/: on a 2-core AMD EPYC (torch 2.13.0) a 1024x1024 bf16 matmul ran 2.1-2.3x
    # fp32, while whole training steps were too noisy under load to rank.
    "avx512_bf16": "CPU has AVX512-BF16 but no AMX: bf16 matmuls can outrun fp32, but autocast's casts may not pay",
    "avx512": "CPU has AVX-512 but no bf16 instructions (no AVX512-BF16, no AMX): no fast bf16",
    # Measured on a 2-core AVX2 machine: bf16 autocast ran the digits CNN about 30x slower than fp32.
    "avx2": "AVX2 only, no fast bf16: bf16 autocast ran a CNN about 30x slower than fp32 on such a CPU",
    "arm": "Arm CPU: bf16 autocast is not measured on Arm yet, so fp32 is kept",
    "other": "CPU without AVX2 or bf16 instructions: no fast bf16",
}


def resolve_tf32(facts: DeviceFacts) -> Choice[bool]:
    """Turn on TF32 matmuls and convolutions on Ampere and newer GPUs.

    TF32 keeps fp32's range with a 10-bit mantissa; PyTorch documents its accuracy trade-off at
    https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices
    """
    if facts.type != "cuda":
        return Choice(False, f"not available on {facts.type}")
    if facts.capability is None or facts.capability < (8, 0):
        return Choice(False, f"{facts.name} predates Ampere; no TF32 units")
    if facts.rocm_tf32 is False:  # torch ignores allow_tf32 there: the fp32 peak is the one its matmuls reach
        return Choice(False, "ROCm runs fp32 matmuls in full fp32 unless HIPBLASLT_ALLOW_TF32=1 is set (torch 2.6+)")
    return Choice(True, f"{facts.name} has TF32 tensor cores; fp32 matmuls run on them")


def live_candidate(requested: str, chosen: str, facts: DeviceFacts) -> PrecisionName | None:
    """The precision a run's own first steps time against the rule's ``chosen``, where "auto" was left to the rule:
    bf16-mixed where the device has fast bf16 and the rule kept fp32, fp32 where the rule chose bf16-mixed; None
    elsewhere (fp16 needs a loss scale from the first step, so it is never switched to or from mid-run)."""
    if requested != "auto":
        return None
    if chosen == "fp32" and "bf16-mixed" in fast_precisions(facts):
        return "bf16-mixed"
    return "fp32" if chosen == "bf16-mixed" else None


def fast_precisions(facts: DeviceFacts) -> list[PrecisionName]:
    """The mixed precisions the device has fast arithmetic for: the only ones worth timing against fp32.

    A CPU without bf16 instructions runs bf16 autocast many times slower (about 30x measured on a
    2-core AVX2 machine), so it is not tried there; MPS is not measured yet.
    """
    if facts.type == "cuda":
        return ["bf16-mixed"] if facts.bf16 else ["fp16-mixed"] if facts.tensor_cores else []
    if facts.type == "cpu" and facts.bf16:
        return ["bf16-mixed"]
    return []
