"""Memory-layout axis: channels_last for convolutional models."""

from __future__ import annotations

from torch import nn

from redline.hardware.device import DeviceFacts
from redline.plan import Choice, parse_switch


def has_conv2d(model: nn.Module) -> bool:
    """Whether ``model`` has a 2-d convolution: the layers channels_last lays out."""
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def resolve_channels_last(
    requested: str | bool, facts: DeviceFacts, *, has_conv2d: bool, precision: str, sharded: bool = False
) -> Choice[bool]:
    """Use channels_last where tensor cores, or a CPU's AMX tiles, run the convolutions.

    cuDNN's tensor-core convolutions want NHWC; in NCHW they pay transposes around every layer
    (https://pytorch.org/tutorials/intermediate/memory_format_tutorial.html). So do oneDNN's bf16
    convolutions on AMX: the digits CNN's bf16 training step ran 1.32-1.36x faster in NHWC on a Xeon
    with AMX, while its fp32 step gained nothing steady (0.86-1.10x, benchmarks/results/trial-layout-cpu.md).

    A ``sharded`` (FSDP) model stays NCHW: FSDP shards contiguous parameters only, and NHWC weights are not.
    """
    value = parse_switch("channels_last", requested)
    if sharded and has_conv2d and value is not False:
        told = "auto:" if value is None else "requested, but"
        return Choice(False, f"{told} FSDP shards contiguous parameters only, and NHWC convolution weights are not")
    if value is None:
        if not has_conv2d:
            return Choice(False, "auto: the model has no 2-d convolution")
        if facts.type == "cpu":
            if facts.cpu_isa == "amx" and precision == "bf16-mixed":
                return Choice(True, "auto: bf16 convolutions run on this CPU's AMX tiles, which want NHWC")
            return Choice(False, f"auto: NCHW is as fast for {precision} convolutions on this CPU")
        if not facts.tensor_cores:
            return Choice(False, f"auto: no tensor cores on {facts.name}; NCHW is as fast")
        if precision == "fp32" and (facts.capability or (0, 0)) < (8, 0):
            return Choice(False, "auto: fp32 convolutions without TF32 do not use tensor cores")
        return Choice(True, f"auto: convolutions run on {facts.name}'s tensor cores, which want NHWC")
    if value and not has_conv2d:
        return Choice(False, "requested, but the model has no 2-d convolution")
    return Choice(bool(value), "requested")
