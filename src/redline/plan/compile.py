"""Compile axis: whether torch.compile is applied to the model."""

from __future__ import annotations

from collections.abc import Callable

from redline.hardware.device import DeviceFacts
from redline.plan import Choice, parse_switch

# A compile costs tens of seconds before the first step; on a GPU it usually repays that within a
# few thousand steps (torch.compile tutorial: 1.3-2x on common models). Below this many planned
# steps auto stays eager, so a short run is never slower than the plain loop.
MIN_STEPS_CUDA = 2000


def resolve_compile(
    requested: str | bool,
    facts: DeviceFacts,
    *,
    planned_steps: int | None,
    supported: Callable[[], tuple[bool, str]],
) -> Choice[bool]:
    """Decide whether to compile.

    ``supported()`` says whether torch.compile can run here and why not; it is asked only when a
    compile is still in question, since finding out imports the compiler stack (seconds).
    """
    value = parse_switch("compile", requested)
    if value is False:
        return Choice(False, "requested")
    if value is True:
        can, why_not = supported()
        return Choice(True, "requested") if can else Choice(False, f"requested, but {why_not}; running eagerly")
    if facts.type != "cuda":
        # Measured on a 2-core CPU: 1.0-1.2x at steady state for about 20 s of compiling.
        return Choice(False, f"auto: on {facts.type} the gain (about 1.1x measured) rarely repays the compile")
    if planned_steps is None:
        return Choice(False, "auto: run length unknown, a compile might not repay itself; pass compile='on'")
    if planned_steps < MIN_STEPS_CUDA:
        return Choice(False, f"auto: {planned_steps} steps are too few to repay a compile (< {MIN_STEPS_CUDA})")
    can, why_not = supported()
    if not can:
        return Choice(False, f"auto: {why_not}")
    return Choice(True, f"auto: {planned_steps} steps on {facts.name} repay the compile time")
