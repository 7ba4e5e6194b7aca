"""CUDA graphs axis for training: whether the forward and backward replay as captured CUDA graphs.

A graph replays a step's kernels in one launch, which is what a model bound by launches needs (the digits
CNN kept an H200 busy 4% of its step); it does nothing for a model whose kernels keep the GPU busy. So
"auto" proposes graphs on a CUDA device and the run's first steps decide (runtime/compile_check.py). What
a graphed step needs (runtime/graphs.py): one backward per optimizer step, gradients freed after it, one
process, and no recomputation in backward. Where the run asks otherwise, "auto" leaves graphs off and
"on" is refused with the fix.
"""

from __future__ import annotations

from redline.errors import ConfigError, invalid
from redline.hardware.device import DeviceFacts
from redline.plan import Choice, parse_switch
from redline.plan.inference import check_cuda_graphs


def resolve_graphs(
    requested: str | bool,
    facts: DeviceFacts,
    *,
    compile: str,
    compile_mode: str = "default",
    strategy: str = "single",
    world_size: int = 1,
    grad_accum: int = 1,
    micro_batch: int | str | None = None,
    checkpointing: str = "off",
) -> Choice[bool]:
    """Decide whether the training forward and backward run as CUDA graphs (for "auto": a proposal the run checks).

    ``compile`` is the compile request: a compile asked for gets its own graphs from torch.compile's
    ``reduce-overhead`` mode, and one model is not graphed twice (so "auto" stays off with that mode too).
    """
    value = check_cuda_graphs(requested, facts.type)  # "on" off CUDA is refused here
    if value is False:
        return Choice(False, "requested")
    blocker = _blocker(strategy, world_size, grad_accum, micro_batch, checkpointing)
    if value is True:
        if parse_switch("compile", compile) is True:
            raise invalid(
                "cuda_graphs", requested, "'auto' or 'off' with compile='on'",
                "for a compiled model's CUDA graphs pass compile_mode='reduce-overhead'; for graphs without a compile, "
                "compile='off'",
            )  # fmt: skip
        if blocker:
            raise ConfigError(
                f"cuda_graphs='on' cannot graph a step with {blocker}: the graph's backward hands out gradients from "
                "its own buffers, once per optimizer step, in one process\nhint: pass cuda_graphs='auto' or 'off'"
            )
        return Choice(True, "requested")
    if facts.type != "cuda":
        return Choice(False, f"auto: CUDA graphs need a CUDA device, this is {facts.type}")
    if parse_switch("compile", compile) is True:
        return Choice(False, "auto: compile was requested (compile_mode='reduce-overhead' graphs a compiled model)")
    if compile_mode == "reduce-overhead":
        return Choice(False, "auto: compile_mode='reduce-overhead' graphs the model where it is compiled")
    if blocker:
        return Choice(False, f"auto: off with {blocker}")
    return Choice(
        True,
        "auto: the forward and backward captured as CUDA graphs replay in one launch each (a small model is bound by "
        "launches)",
    )


def _blocker(strategy: str, world_size: int, grad_accum: int, micro_batch: int | str | None, checkpointing: str) -> str:
    """What in the run a graphed step cannot follow, in words, or ""."""
    if world_size > 1:
        return f"{world_size} processes (gradients are reduced outside the graph)"
    if strategy != "single":
        return f"strategy={strategy!r} (its hooks reduce or gather outside the graph)"
    if grad_accum > 1:
        return f"grad_accum={grad_accum} (several backwards per optimizer step)"
    if micro_batch is not None:
        return f"micro_batch={micro_batch!r} (several backwards per optimizer step)"
    if checkpointing == "on":
        return "activation checkpointing (recomputation in backward)"
    return ""
