"""Ops traced as CUDA runs them, where a CUDA kernel or CUDA's autocast keeps other tensors than the CPU's.

A step is traced on the CPU; three things a GPU does differently change what a step keeps for backward:
- attention: CUDA's fused kernels keep no (seq x seq) matrix (memory/attention.py);
- dropout: CUDA's fused kernel (``native_dropout``) keeps a one-byte mask, where the CPU keeps a noise tensor
  of the input's dtype (aten/src/ATen/native/Dropout.cpp, ``is_fused_kernel_acceptable``);
- autocast: CUDA's runs pow, exp, log, layer_norm, softmax, sum and a few more in fp32 (their outputs, and the
  copies cast for them, twice a bf16 tensor's size), the CPU's in the low precision
  (aten/src/ATen/autocast_mode.cpp: CUDA's "fp32" and "fp32_set_opt_dtype" lists against the CPU's).
``CudaOps`` intercepts those calls under the trace and runs them the CUDA way; all else runs as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from redline.memory.attention import LOW_PRECISION, fused_attention
from redline.runtime.attention_mode import AttentionMode

Handler = Callable[..., Any]

# In CUDA's autocast "fp32" list and not in the CPU's: floating inputs are cast to fp32.
_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "layer_norm", "group_norm", "logsumexp", "renorm", "dist", "pdist",
)  # fmt: skip
_FP32_FUNCTIONAL = (F.softplus, F.layer_norm, F.group_norm, F.cosine_similarity, F.pdist)
# In CUDA's "fp32_set_opt_dtype" list and not in the CPU's: computed with dtype=float32 unless a dtype is given.
_FP32_DTYPE = ("softmax", "log_softmax", "cumsum", "cumprod", "sum")
_FP32_DTYPE_FUNCTIONAL = (F.softmax, F.log_softmax, torch.linalg.vector_norm, torch.linalg.matrix_norm)


class CudaOps(AttentionMode):
    """Run attention (the calls inside ``nn.MultiheadAttention`` too), dropout and the ops CUDA's autocast puts in
    fp32 as a CUDA step runs them."""

    def __init__(self, attention: str = "auto") -> None:
        super().__init__()
        self.attention = attention  # the kernel the run prefers ("auto": torch's pick per call)

    def attend(self, sdpa: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return fused_attention(self.attention, sdpa, *args, **kwargs)

    def other(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        handler = _HANDLERS.get(func)
        return func(*args, **kwargs) if handler is None else handler(func, *args, **kwargs)


def _dropout(func: Handler, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    """``F.dropout`` as CUDA runs it: the fused kernel (a bool mask kept) where training with 0 < p < 1;
    in place, CUDA too keeps a noise tensor of the input's dtype, so that runs as it is."""
    if training and not inplace and 0.0 < p < 1.0 and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    return func(input, p, training, inplace)


def _in_fp32(func: Handler, *args: Any, **kwargs: Any) -> Any:
    """CUDA autocast's "fp32" rule: floating fp16/bf16 inputs are cast to fp32 first."""
    if not torch.is_autocast_enabled("cpu"):  # the trace's stand-in for CUDA's autocast
        return func(*args, **kwargs)
    upcast = tree_map_only(torch.Tensor, _upcast, (args, kwargs))
    return func(*upcast[0], **upcast[1])


def _with_fp32_dtype(func: Handler, *args: Any, **kwargs: Any) -> Any:
    """CUDA autocast's "fp32_set_opt_dtype" rule: a floating first input is reduced with dtype=float32, unless
    the call names a dtype."""
    first = args[0] if args else kwargs.get("input")
    named = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
    eligible = isinstance(first, torch.Tensor) and first.is_floating_point() and first.dtype != torch.float64
    if not torch.is_autocast_enabled("cpu") or named or not eligible:
        return func(*args, **kwargs)
    return func(*args, **{**kwargs, "dtype": torch.float32})


def _upcast(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in LOW_PRECISION else tensor


def _handlers() -> dict[Callable[..., Any], Handler]:
    """Each intercepted callable (the function, the Tensor method, the operator) and its handler."""
    handlers: dict[Callable[..., Any], Handler] = {F.dropout: _dropout}
    rules = ((_FP32, _FP32_FUNCTIONAL, _in_fp32), (_FP32_DTYPE, _FP32_DTYPE_FUNCTIONAL, _with_fp32_dtype))
    for names, functional, handler in rules:
        for name in names:
            for owner in (torch, torch.Tensor):
                if hasattr(owner, name):
                    handlers[getattr(owner, name)] = handler
        handlers.update(dict.fromkeys(functional, handler))
    handlers[torch.Tensor.__pow__] = handlers[torch.Tensor.__rpow__] = _in_fp32
    return handlers


_HANDLERS = _handlers()
