"""FLOPs of a training step, a measured matmul peak, and model FLOPs utilisation (MFU).

``count_train_flops`` counts with ``torch.utils.flop_counter.FlopCounterMode`` on the meta device:
the model's structure is copied with meta tensors in place of its weights, so counting a large model
that lives on a GPU costs neither compute nor memory. FlopCounterMode counts matmuls, convolutions
and attention (2 FLOPs per multiply-add); elementwise work, norms and softmax count as zero, as in
the PaLM definition of MFU (https://arxiv.org/abs/2204.02311, appendix B).
"""

from __future__ import annotations

import logging
import sys
import time
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

from redline.config import positive_int
from redline.errors import invalid

log = logging.getLogger(__name__)


def count_train_flops(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], batch: Any) -> int | None:
    """Return the FLOPs of one training step, forward and backward, on ``batch = (inputs, targets)``.

    The count runs ``loss_fn(model(inputs), targets)`` and its backward on a meta copy of the model,
    so the real model keeps its weights, gradients, mode and the global RNG state. Any failure (a
    model that cannot run on meta tensors, say) returns None, which MFU shows as "n/a"; it never
    raises. The optimizer step is not counted (elementwise), nor is activation recomputation.
    """
    try:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(f"batch is a {type(batch).__name__}, not an (inputs, targets) pair")
        inputs, targets = batch
        memo: dict[int, Any] = {}
        # Dropout on meta tensors draws nothing, but a model may draw from the CPU generator itself
        # (torch.rand without a device); the count must not shift the run's random stream.
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            clone = _meta_clone(_unwrap(model), memo)
            loss_clone = _meta_clone(loss_fn, memo) if isinstance(loss_fn, nn.Module) else loss_fn
            with FlopCounterMode(display=False) as counter:
                loss = loss_clone(clone(_to_meta(inputs)), _to_meta(targets))
                if loss.requires_grad:
                    loss.backward()
        return int(counter.get_total_flops())
    except Exception as exc:  # a diagnostic must never stop training: the caller shows "n/a"
        log.debug("counting FLOPs on the meta device failed: %s: %s", type(exc).__name__, exc)
        return None


def measure_matmul_tflops(
    device: torch.device,
    dtype: torch.dtype,
    *,
    size: int | None = None,
    repeats: int = 20,
    blocks: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Time ``repeats`` square matmuls of side ``size`` on ``device`` after a warm-up, in ``blocks`` timed
    apart; return the fastest block's TFLOP/s.

    The default size is 4096 on an accelerator and 256 on a CPU, where the whole call takes a few
    tens of milliseconds. A peak is what the device does undisturbed: a descheduled thread stalls a
    CPU matmul many times over (a 2-core machine timed 2 GFLOP/s in one go while another job held its
    cores, 150 without), so the fastest block is the one that counts. A stall that outlasts every
    block still shows: ``share_of_peak`` leaves such a peak out. The operands come from a private
    generator, so the global RNG is untouched.
    """
    n = size if size is not None else (256 if device.type == "cpu" else 4096)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise invalid("size", size, "a positive integer, or None for the device's default")
    positive_int("repeats", repeats)
    positive_int("blocks", blocks)
    blocks = min(blocks, repeats)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):  # warm-up: kernel selection, clocks, caches
        torch.mm(a, b, out=out)
    _synchronize(device)
    fastest = float("inf")
    for _ in range(blocks):
        start = clock()
        for _ in range(repeats // blocks):
            torch.mm(a, b, out=out)
        _synchronize(device)
        fastest = min(fastest, clock() - start)
    return 2 * n**3 * (repeats // blocks) / max(fastest, 1e-9) / 1e12


_MATMUL_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "fp32": torch.float32}
_BY_DTYPE = {dtype: precision for precision, dtype in _MATMUL_DTYPES.items()}


def matmul_precision(precision: str, model: nn.Module) -> str | None:
    """The precision whose peak ``model``'s matmuls run at, under the run's ``precision``: its own under autocast
    (bf16-mixed, fp16-mixed); under fp32, that of the dtype most of the parameters hold, since a bfloat16 or float16
    model trained as it is runs bf16 or fp16 matmuls, not fp32 ones. Frozen parameters count too: a frozen bf16 base
    with fp32 adapters runs most of its matmuls in bf16. None where that dtype has no peak in the catalog (float64):
    no datasheet and no matmul peak then stand for the run."""
    if precision != "fp32":
        return precision
    dtype = weights_dtype(model)
    return _BY_DTYPE.get(dtype) if dtype is not None else precision


def weights_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype most of ``model``'s parameters hold, frozen or trained, by element count; None without any."""
    counts: dict[torch.dtype, int] = {}
    for param in model.parameters():
        counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    return max(counts, key=lambda dtype: counts[dtype]) if counts else None


def matmul_peak(device: torch.device, precision: str, *, blocks: int = 5) -> float | None:
    """The matmul TFLOP/s of ``device`` in ``precision``'s compute dtype, or None where it cannot be
    measured now (a GPU the run left full)."""
    try:
        return measure_matmul_tflops(
            device, _MATMUL_DTYPES.get(precision, torch.float32), repeats=4 * blocks, blocks=blocks
        )
    except (RuntimeError, torch.OutOfMemoryError):  # the ratio is optional
        return None


def share_of_peak(flops_per_s: float, peak_tflops: float | None) -> float | None:
    """``flops_per_s`` over a measured matmul peak; None without a peak, or where the run outpaced it: no
    model beats a plain matmul, so the measurement was stalled (a busy machine) and its share is noise."""
    if not peak_tflops or flops_per_s > peak_tflops * 1e12:
        return None
    return flops_per_s / (peak_tflops * 1e12)


def mfu(flops_per_s: float, peak_tflops: float | None) -> float | None:
    """Return model FLOPs utilisation, achieved FLOP/s over the peak (0.45 means 45%); None without a peak."""
    if peak_tflops is None or peak_tflops <= 0:
        return None
    return flops_per_s / (peak_tflops * 1e12)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _unwrap(model: nn.Module) -> nn.Module:
    # Count the plain module under torch.compile's OptimizedModule and (Distributed)DataParallel:
    # running those wrappers would compile for meta tensors or start gradient communication.
    while True:
        inner = (
            getattr(model, "module", None) if isinstance(model, (nn.DataParallel, DistributedDataParallel)) else None
        )
        inner = inner if inner is not None else getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _meta_clone(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """Return a shallow copy of ``module``'s tree whose parameters and buffers are empty meta tensors.

    Each module is copied, not deep-copied: attributes are shared, but what the count's forward
    assigns (a cache, a counter) lands on the copy. Tied weights and shared modules stay tied. A
    module sharded by FSDP2 is copied as its own class, without FSDP's hooks, with whole-model shapes.
    """
    if id(module) in memo:
        clone: nn.Module = memo[id(module)]
        return clone
    # Not copy.copy: on an FSDP2 module that calls the user's __init__ (FSDPModule.__new__ builds the
    # original class anew), which draws fresh weights from the global RNG and needs __init__'s arguments.
    cls = _unsharded_class(type(module))
    clone = cls.__new__(cls)
    memo[id(module)] = clone
    state = clone.__dict__
    state.update(module.__dict__)
    for hooks in ("_forward_pre_hooks", "_forward_hooks"):  # FSDP's would all-gather the real weights
        if hooks in state:
            state[hooks] = type(state[hooks])(
                (key, hook) for key, hook in state[hooks].items() if not _is_fsdp_hook(hook)
            )
    state["_parameters"] = {k: None if p is None else _meta_parameter(p, memo) for k, p in module._parameters.items()}
    state["_buffers"] = {k: None if b is None else _meta_tensor(b, memo) for k, b in module._buffers.items()}
    state["_modules"] = {k: None if m is None else _meta_clone(m, memo) for k, m in module._modules.items()}
    for name, value in list(state.items()):  # a plain tensor attribute (a mask kept unregistered) goes to meta too
        if isinstance(value, torch.Tensor):
            state[name] = _meta_tensor(value, memo)
    # An instance-level forward (torch.compile's wrapper, redline's compile_module) is bound to the
    # real module and would run its real weights; the copy runs the class's own, eager forward.
    forward = state.pop("forward", None)
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        state["forward"] = types.MethodType(forward.__func__, clone)
    return clone


def _unsharded_class(cls: type[nn.Module]) -> type[nn.Module]:
    """Return the user's class under FSDP2's dynamic ``FSDP<Class>``; ``cls`` itself for any other."""
    if any(base.__name__ == "FSDPModule" for base in cls.__mro__):  # by name: torch < 2.6 keeps it private
        return cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)]  # [FSDP<Orig>, FSDPModule, Orig, ...]
    return cls


def _is_fsdp_hook(hook: Any) -> bool:
    return str(getattr(hook, "__module__", "")).startswith(("torch.distributed.fsdp", "torch.distributed._composable"))


def _meta_parameter(param: nn.Parameter, memo: dict[int, Any]) -> nn.Parameter:
    if id(param) not in memo:
        memo[id(param)] = nn.Parameter(_meta_empty(param), requires_grad=param.requires_grad)
    meta: nn.Parameter = memo[id(param)]
    return meta


def _meta_tensor(tensor: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
    if id(tensor) not in memo:
        memo[id(tensor)] = _meta_empty(tensor)
    meta: torch.Tensor = memo[id(tensor)]
    return meta


def _meta_empty(tensor: torch.Tensor) -> torch.Tensor:
    """An empty plain meta tensor of ``tensor``'s shape; a DTensor's is the whole tensor's, not this rank's shard."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    if dtensor_module is not None and isinstance(tensor, dtensor_module.DTensor):
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    return torch.empty_like(tensor, device="meta")


def _to_meta(obj: Any) -> Any:
    """Return ``obj`` with every tensor, however nested in tuples, lists and dicts, as an empty meta tensor."""
    if isinstance(obj, torch.Tensor):
        meta = torch.empty_like(obj, device="meta")
        return meta.requires_grad_() if obj.requires_grad else meta
    if isinstance(obj, Mapping):
        return {k: _to_meta(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_to_meta(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_meta(v) for v in obj)
    return obj
