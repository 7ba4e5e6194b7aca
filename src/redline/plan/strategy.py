"""Strategy axis: one device, data parallel (DDP), or fully sharded (FSDP2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, cast, get_args

from redline.errors import invalid, one_of
from redline.plan import Choice

StrategyName = Literal["single", "ddp", "fsdp"]
STRATEGIES: tuple[str, ...] = get_args(StrategyName)

# Weights, gradients and Adam's two moments in fp32: 16 bytes a parameter (ZeRO paper, section 3:
# https://arxiv.org/abs/1910.02054). DDP keeps all of it on every device; half the device is left for
# activations and the allocator's slack.
BYTES_PER_PARAM = 16
STATE_SHARE = 0.5


def resolve_strategy(
    requested: str, *, world_size: int, params: int, device_mem_gib: float | None
) -> Choice[StrategyName]:
    """Pick DDP when model, gradients and optimizer state fit on one device, else FSDP."""
    if requested not in (*STRATEGIES, "auto"):
        raise one_of("strategy", requested, ("auto", *STRATEGIES))
    state_gib = params * BYTES_PER_PARAM / 2**30
    if requested != "auto":
        if requested == "single" and world_size > 1:
            raise invalid(
                "strategy", requested, "'ddp' or 'fsdp' with several processes", "use strategy='auto' under launch"
            )
        return Choice(cast(StrategyName, requested), "requested")
    if world_size == 1:
        return Choice("single", "auto: one process")
    if device_mem_gib is None:
        return Choice("ddp", f"auto: {world_size} processes; host memory holds the full {_size(state_gib)} state")
    if state_gib <= STATE_SHARE * device_mem_gib:
        return Choice(
            "ddp",
            f"auto: weights+grads+Adam state {_size(state_gib)} fit in half of {device_mem_gib:.0f} GiB; "
            f"replicated on {world_size} devices",
        )
    return Choice(
        "fsdp",
        f"auto: weights+grads+Adam state {state_gib:.1f} GiB exceed half of {device_mem_gib:.0f} GiB; "
        f"sharded over {world_size} devices ({state_gib / world_size:.1f} GiB each)",
    )


def will_shard(requested: str, *, world_size: int, params: Callable[[], int], device_mem_gib: float | None) -> bool:
    """Whether ``resolve_strategy`` picks FSDP for this run, before its model is built: ``params`` (the model's count)
    is called only where "auto" needs it, several processes on devices that say their memory."""
    if requested != "auto" or world_size == 1 or device_mem_gib is None:
        return requested == "fsdp"
    return resolve_strategy(requested, world_size=world_size, params=params(), device_mem_gib=device_mem_gib).value == (
        "fsdp"
    )


def _size(gib: float) -> str:
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"
