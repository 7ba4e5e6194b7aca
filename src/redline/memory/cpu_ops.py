"""A CPU step as the Runtime runs it: the layout it gives the model, and the copies its kernels make.

Layout: a Runtime lays a convolutional model out channels_last where its resolver says so (bf16 on a CPU with
AMX, plan/layout.py), and with it the batch's images. The CPU is given to the estimate as data (``cpu_isa``),
or taken from this machine as a Runtime takes it (``REDLINE_CPU`` fakes it).

Copies: the trace allocates what each op returns, and some CPU kernels allocate copies of their own while
they run. The pooling backwards work in the memory format of the incoming gradient
(``grad_output.suggest_memory_format()``), take ``.contiguous(that format)`` of the gradient they write and
of max pooling's indices, and copy the result back (aten/src/ATen/native/cpu/MaxPoolKernel.cpp,
AvgPoolKernel.cpp, AdaptiveAvgPoolKernel.cpp: ``cpu_*_pool_backward``). A channels_last model that flattens
into a linear head gets that gradient back in NCHW, so each such backward holds a second copy of its input's
gradient, and max pooling a copy of its int64 indices, beside the result: on a Xeon with AMX the digits CNN's
bf16 step measured 30-34% above a trace that counted neither the layout nor the copies
(benchmarks/results/memory-xeon-amx.md).

An LSTM layer's oneDNN kernel holds more: the workspace it returns for the backward, which torch's meta kernel
returns empty, and its reordered weights and scratchpad while it runs (memory/cpu_lstm.py).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch._prims_common import suggest_memory_format  # Tensor.suggest_memory_format, which Python lacks
from torch.utils._python_dispatch import TorchDispatchMode

from redline.hardware.device import FAKE_CPU_ENV, CpuIsa, DeviceFacts, DeviceType, probe_cpu_isa
from redline.memory.cpu_lstm import lstm_backward, lstm_forward
from redline.memory.meta import swap_tensors
from redline.plan import Choice
from redline.plan.layout import has_conv2d, resolve_channels_last

_aten = torch.ops.aten
# Each pooling backward, and the positions of its arguments that the kernel copies into grad_output's
# format (grad_output itself at 0; max pooling's indices last).
_COPIED = {
    _aten.max_pool2d_with_indices_backward.default: (0, 7),
    _aten.avg_pool2d_backward.default: (0,),
    _aten._adaptive_avg_pool2d_backward.default: (0,),
}
# The ops whose outputs a rule replaces, after holding what their CPU kernel works in.
_RULES = {_aten.mkldnn_rnn_layer.default: lstm_forward, _aten.mkldnn_rnn_layer_backward.default: lstm_backward}


class CpuKernels(TorchDispatchMode):
    """Hold, while a pooling backward or an LSTM layer runs, the copies and buffers its CPU kernel makes, and an
    LSTM's workspace as ``cpu_isa``'s kernels size it; enter it above the tracker."""

    def __init__(self, cpu_isa: CpuIsa = "other") -> None:
        super().__init__()
        self.cpu_isa = cpu_isa

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        copied = _COPIED.get(func)
        if copied is not None:
            working = pooling_copies([args[i] for i in copied], out)
            del working  # freed as the kernel returns: held only beside its output
        rule = _RULES.get(func)
        return out if rule is None else rule(args, out, self.cpu_isa)


def pooling_copies(inputs: list[torch.Tensor], grad_input: torch.Tensor) -> list[torch.Tensor]:
    """The copies a CPU pooling backward makes: of each of ``inputs`` (grad_output first) and of the
    ``grad_input`` it returns that is not laid out in grad_output's memory format; empty tensors of their size."""
    layout = suggest_memory_format(inputs[0])
    return [
        torch.empty_like(tensor, memory_format=layout)
        for tensor in (*inputs, grad_input)
        if not tensor.is_contiguous(memory_format=layout)
    ]


def device_facts(target: str, cpu_isa: CpuIsa | None) -> DeviceFacts:
    """The facts of the device a step is traced for: on a CPU, its instruction set (this machine's where None, as
    a Runtime here takes it; ``REDLINE_CPU`` fakes it), named as the notes say it."""
    if target != "cpu":
        return DeviceFacts(type=cast(DeviceType, target), name=f"a {target} device")
    if cpu_isa is not None:
        return DeviceFacts(type="cpu", name=f"the CPU given ({cpu_isa})", cpu_isa=cpu_isa)
    isa, faked = probe_cpu_isa()
    name = f"the CPU {FAKE_CPU_ENV} fakes ({isa})" if faked else f"this machine's CPU ({isa})"
    return DeviceFacts(type="cpu", name=name, cpu_isa=isa, cpu_isa_faked=faked)


def cpu_layout(model: nn.Module, precision: str, device: DeviceFacts) -> Choice[bool]:
    """Whether the Runtime lays ``model`` out channels_last on ``device`` (its own resolver, as "auto"). On CUDA
    the trace keeps NCHW: which GPU has tensor cores is not known here, and the sizes are the same."""
    if device.type != "cpu":
        return Choice(False, "not traced for a CPU")
    choice = resolve_channels_last("auto", device, has_conv2d=has_conv2d(model), precision=precision)
    return Choice(choice.value, f"as a Runtime on {device.name} lays the model out ({choice.reason})")


def to_channels_last(model: nn.Module) -> None:
    """Lay ``model``'s 4-d tensors out NHWC, as ``model.to(memory_format=torch.channels_last)`` does for real ones."""
    swap_tensors(model, lambda t: t.detach().contiguous(memory_format=torch.channels_last) if t.dim() == 4 else None)
