"""Running ``F.scaled_dot_product_attention`` on a chosen kernel, and finding which kernels take a model's calls.

torch keeps the enabled attention kernels per process, as it keeps TF32: ``prefer_kernel`` enables the chosen one
first and math after it (math takes any call), and puts torch's flags back when it is left. ``attention_calls``
records what a model's forward passes to the attention function, so `redline tune` times only the kernels that
take those calls (``kernels_taking``) and skips the axis for a model that never calls it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
_NAMES = {backend.value: name for name, backend in BACKENDS.items()}


def prefer_kernel(name: str) -> contextlib.AbstractContextManager[Any]:
    """Run attention on kernel ``name`` wherever it takes the call, else on math; torch's flags come back on exit."""
    chosen = BACKENDS[name]
    try:
        return sdpa_kernel([chosen, SDPBackend.MATH], set_priority=True)
    except TypeError:  # a torch without priorities: math would come before cuDNN in its order, so the kernel alone
        return sdpa_kernel([chosen])


@dataclass(frozen=True)
class AttentionCall:
    """What one call passed to the attention function: its inputs' shapes and dtypes, and its options."""

    shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    dtype: torch.dtype
    mask: tuple[tuple[int, ...], torch.dtype] | None
    dropout_p: float
    is_causal: bool
    enable_gqa: bool

    def tensors(self, device: torch.device, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Empty inputs like the call's on ``device``, in ``dtype`` (as autocast casts them), for torch's checks."""
        dtype = dtype or self.dtype
        query, key, value = (torch.empty(shape, device=device, dtype=dtype) for shape in self.shapes)
        mask = torch.empty(self.mask[0], device=device, dtype=self.mask[1]) if self.mask is not None else None
        return {"query": query, "key": key, "value": value, "attn_mask": mask}


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[AttentionCall] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append(_call_of(*args, **kwargs))
        return func(*args, **kwargs)


def _call_of(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> AttentionCall:
    mask = (tuple(attn_mask.shape), attn_mask.dtype) if attn_mask is not None else None
    shapes = (tuple(query.shape), tuple(key.shape), tuple(value.shape))
    return AttentionCall(shapes, query.dtype, mask, float(dropout_p), bool(is_causal), bool(enable_gqa))


def attention_calls(model: nn.Module, inputs: Any) -> list[AttentionCall]:
    """The distinct calls ``model``'s forward on ``inputs`` makes to ``F.scaled_dot_product_attention``, in order.

    The forward runs once, without autograd and with the random streams put back, in the model's own mode.
    """
    recorder = _Recorder()
    devices = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
    with torch.no_grad(), torch.random.fork_rng(devices=devices), recorder:
        model(inputs)
    return list(dict.fromkeys(recorder.calls))


def torch_pick(call: AttentionCall, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    """The kernel torch picks for ``call`` under the flags now set (None where none takes it)."""
    try:
        with warnings.catch_warnings():  # torch warns why each kernel it passes over cannot take the call
            warnings.simplefilter("ignore")
            picked = torch._fused_sdp_choice(  # private, tolerated: torch's own choice of kernel for these inputs
                **call.tensors(device, dtype), dropout_p=call.dropout_p, is_causal=call.is_causal,
                enable_gqa=call.enable_gqa,
            )  # fmt: skip
    except (RuntimeError, AttributeError, TypeError):  # no kernel takes it, or a torch without the check
        return None
    return _NAMES.get(int(picked))


def kernels_taking(calls: list[AttentionCall], device: torch.device, dtype: torch.dtype | None = None) -> list[str]:
    """The kernels that take every one of ``calls`` on ``device`` (inputs cast to ``dtype``), in torch's names."""
    taking = []
    for name, backend in BACKENDS.items():
        with sdpa_kernel([backend]):
            if calls and all(torch_pick(call, device, dtype) == name for call in calls):
                taking.append(name)
    return taking
