"""Attention traced as a GPU runs it: the fused kernel CUDA picks, whatever kernel the CPU would pick.

``F.scaled_dot_product_attention`` chooses its kernel by device. On a CPU, dropout or (for some inputs) a
mask sends it to the math path, which keeps the (batch, heads, seq, seq) attention probabilities, their
dropout mask and the dropped probabilities for backward: transformers' GPT-2 in training (dropout 0.1) is
traced so. On CUDA the flash and memory-efficient kernels keep only the output, a log-sum-exp of
(batch, heads, seq) in fp32 and the dropout RNG's seed and offset; nothing of seq x seq size. So, when the
step is traced for CUDA, ``fused_attention`` runs the kernel CUDA would choose, as its fake-tensor kernel,
in place of the CPU's: flash for fp16/bf16 without a mask, memory-efficient for fp32 or with a mask, and
the math path where neither applies (as CUDA does; not the CPU's pick, whose flash kernel takes calls CUDA's does
not). A run that prefers a kernel (`--attention KERNEL`) is traced on it where it takes the call, and on the math
path elsewhere, as it runs.

The rules follow torch's own choice (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
``select_sdp_backend``; attention.cpp, ``scaled_dot_product_attention``) on an Ampere or newer GPU. Where
cuDNN's attention is preferred (Hopper), it keeps what flash keeps: the output and (batch, heads, seq)
statistics in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

Kernel = Literal["flash", "efficient", "cudnn"]

_aten = torch.ops.aten
# The fused kernels tried for a call, in order, for each kernel a run may prefer; math where none takes it.
_TRIED: dict[str, tuple[Kernel, ...]] = {
    "auto": ("flash", "efficient"),
    "flash": ("flash",),
    "cudnn": ("cudnn",),
    "efficient": ("efficient",),
}
LOW_PRECISION = (torch.float16, torch.bfloat16)  # the dtypes autocast and the fused kernels treat as low
_FLASH_HEAD_DIM = 256  # flash's largest head dimension (sdp_utils.cpp, check_head_dim_size_flash)
_CUDNN_HEAD_DIM = 128  # cuDNN's, but on the newest GPUs and cuDNN (sdp_utils.cpp, check_cudnn_tensor_shapes)
_MASK_ALIGNMENT = 8  # the memory-efficient kernel's mask rows start on 8 elements (attention.cpp, preprocess_mask)


def fused_attention(
    preferred: str,
    sdpa: Callable[..., torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The attention output, computed by the kernel CUDA runs for the call where ``preferred`` is "auto", by the
    kernel ``preferred`` where it takes the call, else by the math path (what `--attention KERNEL` runs). Nested
    inputs run on ``sdpa`` itself."""
    if any(t.is_nested for t in (query, key, value)):
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    query, key, value = _autocast(query), _autocast(key), _autocast(value)
    attn_mask = _autocast(attn_mask) if attn_mask is not None else None
    kernel = cuda_kernel(
        query, key, value, attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, dropout_p=dropout_p,
        preferred=preferred,
    )  # fmt: skip
    if kernel in ("flash", "cudnn"):  # cuDNN's keeps what flash keeps: the output and (batch, heads, seq) statistics
        return _flash(query, key, value, dropout_p, is_causal, scale)
    if kernel == "efficient":
        return _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale)
    return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def cuda_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    enable_gqa: bool,
    dropout_p: float = 0.0,
    preferred: str = "auto",
) -> Kernel | None:
    """The fused kernel CUDA runs for these inputs ("flash", "efficient", "cudnn"), or None where it takes the math
    path: torch's pick where ``preferred`` is "auto", else the kernel preferred where it takes them. cuDNN's is
    weighed as taking less than torch lets it (no mask; head dimensions of 128 at most, a multiple of 8; a dropout
    in sixteenths): where it is refused, math runs, and keeps more."""
    tensors = (query, key, value)
    if any(t.dim() != 4 or t.is_nested or t.stride(-1) != 1 for t in tensors):
        return None
    if len({t.dtype for t in tensors}) > 1 or len({t.size(0) for t in tensors}) > 1:
        return None
    dtype, heads, head_dim = query.dtype, query.size(1), query.size(-1)
    same_heads = key.size(1) == heads and value.size(1) == heads
    grouped = enable_gqa and heads % key.size(1) == 0 and heads % value.size(1) == 0
    alignment = 8 if dtype in LOW_PRECISION else 4  # 16 bytes in elements, for tensor cores (minimum_gemm_alignment)
    flash_like = (
        dtype in LOW_PRECISION
        and attn_mask is None
        and key.size(-1) == head_dim == value.size(-1)
        and not (is_causal and query.size(-2) != key.size(-2))
    )
    takes = {
        "flash": flash_like and head_dim <= _FLASH_HEAD_DIM and (same_heads or grouped),
        "cudnn": flash_like
        and head_dim <= _CUDNN_HEAD_DIM
        and head_dim % 8 == 0
        and same_heads
        and float(dropout_p * 16).is_integer(),
        "efficient": dtype in (*LOW_PRECISION, torch.float32)
        and key.size(-1) == head_dim
        and head_dim % alignment == 0
        and value.size(-1) % alignment == 0
        and same_heads
        and (attn_mask is None or attn_mask.dtype in (torch.bool, torch.float32, dtype)),
    }
    return next((kernel for kernel in _TRIED.get(preferred, ()) if takes[kernel]), None)  # math: none tried


def _math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """The math path as CUDA runs it, not the CPU's pick (whose flash kernel takes calls CUDA's does not): autocast
    off inside, as sdpa's own wrapper turns it off (fp16/bf16 inputs are then multiplied in fp32, and the
    (batch, heads, seq, seq) weights kept in fp32); a boolean mask made additive first, as sdpa makes it; dropout
    keeping a one-byte mask, as CUDA's fused dropout does (a CPU's keeps noise of the weights' dtype)."""
    mask = _additive(attn_mask, query.dtype) if attn_mask is not None else None
    shape = (*query.shape[:-1], key.size(-2))
    dropped = torch.empty(shape, dtype=torch.bool, device=query.device) if dropout_p > 0 else None
    # torch warns that a dropout mask given is for tests: estimate.py filters it around the step
    with torch.autocast("cpu", enabled=False):
        return _aten._scaled_dot_product_attention_math(
            query, key, value, mask, dropout_p, is_causal, dropped, scale=scale, enable_gqa=enable_gqa
        )[0]


def _autocast(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as CUDA's autocast hands it to attention (in its lower-precision list): in the autocast dtype
    where it is floating, but float64, which autocast leaves. The trace runs the CPU's autocast at the GPU's dtype,
    so that is the one asked."""
    if not torch.is_autocast_enabled("cpu") or not tensor.is_floating_point() or tensor.dtype == torch.float64:
        return tensor
    return tensor.to(torch.get_autocast_dtype("cpu"))


def _flash(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, is_causal: bool, scale: float | None
) -> torch.Tensor:
    """Flash attention: it saves the output, a (batch, heads, seq) log-sum-exp and the RNG state. Head
    dimensions are padded to a multiple of 8 first, as torch does, and the output cut back."""
    head_dim = query.size(-1)
    scale = head_dim**-0.5 if scale is None else scale  # from the head dimension before padding
    padded = [_pad_last(t, 8) for t in (query, key, value)]
    output = _aten._scaled_dot_product_flash_attention(*padded, dropout_p, is_causal, False, scale=scale)[0]
    return output[..., :head_dim] if output.size(-1) != head_dim else output


def _efficient(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """Memory-efficient attention: it saves the output, a (batch, heads, seq rounded up to 32) log-sum-exp, the
    RNG state and the mask it was given, which torch makes additive (a copy, where the mask is boolean) and
    pads to aligned rows (another, where they are not)."""
    bias = None
    if attn_mask is not None:
        bias = _aligned(_additive(attn_mask, query.dtype))
        bias = bias.expand(query.size(0), query.size(1), query.size(2), key.size(2))
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    efficient = _aten._scaled_dot_product_efficient_attention
    return efficient(query, key, value, bias, grads, dropout_p, is_causal, scale=scale)[0]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as sdpa hands it to a kernel: additive (-inf where a boolean mask is False), a float mask as given."""
    if mask.dtype != torch.bool:
        return mask
    return torch.where(~mask, float("-inf"), torch.zeros((), dtype=dtype))


def _aligned(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as the memory-efficient kernel takes it: its rows aligned to 8 elements (padded, then sliced back
    to its length)."""
    aligned = all(s % _MASK_ALIGNMENT == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1
    if aligned:
        return mask
    length = mask.size(-1)
    return F.pad(mask, (0, _MASK_ALIGNMENT - length % _MASK_ALIGNMENT))[..., :length]


def _pad_last(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -tensor.size(-1) % multiple
    return F.pad(tensor, (0, extra)) if extra else tensor
