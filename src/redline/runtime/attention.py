"""Running ``F.scaled_dot_product_attention`` on a chosen kernel, and finding which kernels take a model's calls.

torch keeps the enabled attention kernels per process, as it keeps TF32: ``prefer_kernel`` enables the chosen one
first and math after it (math takes any call), and puts torch's flags back when it is left. ``attention_calls``
records what a model's forward passes to the attention function, so `redline tune` and the precision trial time only
the kernels that take those calls (``attention_kernels``), and nothing for a model that never calls it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader

from redline.hardware.memory import machine_memory_bytes, memory_limit_bytes, proc_bytes
from redline.runtime.attention_mode import TORCH_SDPA, AttentionMode
from redline.runtime.contract import split_batch
from redline.runtime.precision import AUTOCAST_DTYPES
from redline.runtime.process_holds import hold_setting
from redline.runtime.seed import capture_rng, restore_rng
from redline.runtime.transfer import device_sync, move_to
from redline.task import Task
from redline.task.meta import on_meta

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
_NAMES = {backend.value: name for name, backend in BACKENDS.items()}


@contextlib.contextmanager
def prefer_kernel(name: str) -> Iterator[None]:
    """Run attention on kernel ``name`` wherever it takes the call, else on math; torch's flags come back on exit.

    The flags (which kernels are on, and their order) come back only where they still hold what was set here: a
    caller's own ``sdpa_kernel`` entered and left around a forward in between has set them since, and putting back
    what was found inside it would leave its choice for good. A graph torch.compile builds inside is cached on disk
    under a key of its own: torch's compile caches do not key on the kernel flags, so a graph compiled for math
    attention was served to a later process that asked for flash (and the other way round), running the other kernel
    without a word. Runs that overlap (two Runtimes' kernels) may leave in any order (runtime/process_holds.py).
    """
    with hold_setting("attention", functools.partial(_kernel_preferred, name)):
        yield


def _kernel_preferred(name: str) -> Callable[[], None]:
    """Prefer kernel ``name`` (``prefer_kernel``); return what puts torch's flags and the cache key's tag back."""
    before = sdp_state()
    chosen, math = BACKENDS[name].value, SDPBackend.MATH.value
    order = before[1]
    if order:  # the kernel first, math after it (math would come before cuDNN in torch's own order), the rest after
        head = tuple(dict.fromkeys((chosen, math)))
        _set_sdp_state(set(head), (*head, *(b for b in order if b not in head)))
    else:  # a torch without priorities: the kernel alone
        _set_sdp_state({chosen}, ())
    ours = sdp_state()
    tagged = contextlib.ExitStack()
    tagged.enter_context(_cache_tagged(f"redline attention={name}"))

    def restore() -> None:
        tagged.close()
        if sdp_state() == ours:
            _set_sdp_state({b for b, on in zip(_FLAGS, before[0], strict=True) if on}, before[1])

    return restore


_cuda = torch.backends.cuda
_FLAGS: dict[int, tuple[Callable[[], bool], Callable[[bool], None]]] = {
    SDPBackend.FLASH_ATTENTION.value: (_cuda.flash_sdp_enabled, _cuda.enable_flash_sdp),
    SDPBackend.EFFICIENT_ATTENTION.value: (_cuda.mem_efficient_sdp_enabled, _cuda.enable_mem_efficient_sdp),
    SDPBackend.CUDNN_ATTENTION.value: (_cuda.cudnn_sdp_enabled, _cuda.enable_cudnn_sdp),
    SDPBackend.MATH.value: (_cuda.math_sdp_enabled, _cuda.enable_math_sdp),
}  # torch keeps them per process; the "cuda" names hold for a CPU's kernels too


def sdp_state() -> tuple[tuple[bool, ...], tuple[int, ...]]:
    """Which attention kernels are on, and torch's order of them (empty where this torch has none)."""
    order = getattr(torch._C, "_get_sdp_priority_order", None)  # private, tolerated where absent
    return tuple(get() for get, _ in _FLAGS.values()), tuple(order()) if order is not None else ()


def _set_sdp_state(enabled: set[int], order: tuple[int, ...]) -> None:
    for backend, (_, enable) in _FLAGS.items():
        enable(backend in enabled)
    if order:
        torch._C._set_sdp_priority_order(list(order))


@contextlib.contextmanager
def _cache_tagged(tag: str) -> Iterator[None]:
    """Add ``tag`` to torch.compile's cache keys inside (where this torch has the setting), and put the key's tag
    back after where it is still the one set here."""
    config = getattr(torch.compiler, "config", None)
    before = getattr(config, "cache_key_tag", None)
    if config is None or not isinstance(before, str):
        yield
        return
    ours = f"{before};{tag}" if before else tag
    config.cache_key_tag = ours
    try:
        yield
    finally:
        if config.cache_key_tag == ours:
            config.cache_key_tag = before


@dataclass(frozen=True)
class AttentionCall:
    """What one call passed to the attention function: its inputs' shapes and dtypes, and its options."""

    shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    dtype: torch.dtype
    mask: tuple[tuple[int, ...], torch.dtype] | None
    dropout_p: float
    is_causal: bool
    enable_gqa: bool

    def tensors(self, device: torch.device, dtype: torch.dtype | None = None, *, grad: bool = False) -> dict[str, Any]:
        """Inputs like the call's on ``device``, in ``dtype`` (as autocast casts them): empty for torch's checks, or
        random and needing a gradient (``grad``) to time a forward and backward; a mask of ones."""
        dtype = dtype or self.dtype
        make = functools.partial(torch.randn, requires_grad=True) if grad else torch.empty
        query, key, value = (make(shape, device=device, dtype=dtype) for shape in self.shapes)
        mask = torch.ones(self.mask[0], device=device, dtype=self.mask[1]) if self.mask is not None else None
        return {"query": query, "key": key, "value": value, "attn_mask": mask}

    def under(self, dtype: torch.dtype) -> AttentionCall:
        """The call as autocast to ``dtype`` makes it: its floating-point inputs (float64 apart) in ``dtype``."""
        cast = _cast_to(dtype)
        mask = (self.mask[0], cast(self.mask[1])) if self.mask is not None else None
        return dataclasses.replace(self, dtype=cast(self.dtype), mask=mask)


class _Recorder(AttentionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[AttentionCall] = []

    def attend(self, sdpa: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        self.calls.append(_call_of(*args, **kwargs))
        return sdpa(*args, **kwargs)


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
    cast = _autocast_to(query)  # the dtype the call runs in: autocast casts floating inputs to its own (not float64)
    mask = (tuple(attn_mask.shape), cast(attn_mask.dtype)) if attn_mask is not None else None
    shapes = (tuple(query.shape), tuple(key.shape), tuple(value.shape))
    return AttentionCall(shapes, cast(query.dtype), mask, float(dropout_p), bool(is_causal), bool(enable_gqa))


def _autocast_to(tensor: torch.Tensor) -> Callable[[torch.dtype], torch.dtype]:
    device = tensor.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return lambda dtype: dtype
    return _cast_to(torch.get_autocast_dtype(device))


def _cast_to(low: torch.dtype) -> Callable[[torch.dtype], torch.dtype]:
    return lambda dtype: low if dtype.is_floating_point and dtype != torch.float64 else dtype


def attention_calls(model: nn.Module, inputs: Any) -> list[AttentionCall]:
    """The calls ``model``'s forward on ``inputs`` makes to ``F.scaled_dot_product_attention``, in order, each as
    often as it is made (a layer's each: the attention weights math keeps add up over them).

    The forward runs once, without autograd and with the random streams put back, in the model's own mode.
    """
    devices = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
    with torch.no_grad(), torch.random.fork_rng(devices=devices), recording() as calls:
        model(inputs)
    return calls


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


def kernels_taking(calls: Sequence[AttentionCall], device: torch.device, dtype: torch.dtype | None = None) -> list[str]:
    """The kernels that take every one of ``calls`` on ``device`` (inputs cast to ``dtype``), in torch's names."""
    distinct, taking = list(dict.fromkeys(calls)), []
    for name, backend in BACKENDS.items():
        with sdpa_kernel([backend]):
            if distinct and all(torch_pick(call, device, dtype) == name for call in distinct):
                taking.append(name)
    return taking


def model_attention(task: Task, device: str | torch.device, inputs: Any = None) -> list[AttentionCall]:
    """The calls the task's model makes to ``F.scaled_dot_product_attention`` in a training forward on ``inputs``
    (default: a batch of its data at its batch size, whose attention weights math would keep).

    The model is built on the meta device and run there (shapes alone: no weights, no arithmetic); one that cannot be
    (a module the factory built before, one that loads weights or reads a value) runs as a copy on ``device``, the
    factory's own left as it was. None where both fail (what runs the model then says why). The random streams its
    weights and the samples draw are put back.
    """
    saved = capture_rng()
    try:
        if inputs is None:
            loader = DataLoader(task.train_data, batch_size=task.batch_size, collate_fn=task.collate_fn)
            inputs, _ = split_batch(next(iter(loader)), "train_data")
        built = on_meta(task.build_model)
        tensors = [*built.parameters(), *built.buffers()] if built is not None else []
        if built is not None and tensors and all(t.is_meta for t in tensors):
            with contextlib.suppress(Exception):  # a model that reads a value runs on the device
                return attention_calls(built.train(), move_to(inputs, torch.device("meta")))
        model = copy.deepcopy(task.build_model())  # a factory may hand out one module it keeps
        return attention_calls(model.to(device).train(), move_to(inputs, torch.device(device)))
    except Exception:  # a model or data that cannot be read fails where the run reads it, saying why
        return []
    finally:
        restore_rng(saved)


def math_fits(calls: Sequence[AttentionCall], device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """Whether the attention weights math keeps for the backward (a (batch, heads, queries, keys) tensor per call,
    and as much again for its gradient; the fused kernels keep none) fit in ``MATH_SHARE`` of the memory free."""
    need = 0
    for call in calls:
        query, key = call.shapes[0], call.shapes[1]
        need += 2 * math.prod(query[:-1]) * key[-2] * (dtype or call.dtype).itemsize
    return need <= MATH_SHARE * _free_bytes(device)


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = proc_bytes("/proc/meminfo", "MemAvailable") or machine_memory_bytes()
    limit = memory_limit_bytes()
    return min(available, limit) if limit is not None else available


def attention_kernels(
    calls: Sequence[AttentionCall], device: str | torch.device, precision: str, *, math_on_cuda: bool = False
) -> list[str]:
    """The attention kernels worth timing against torch's own pick ("auto") in ``precision``: those that take every
    one of ``calls`` (their inputs cast as autocast casts them), but the one torch picks for all of them already.
    Math is left out where the attention weights it keeps would not fit (``math_fits``), and on CUDA, where a fused
    kernel takes any call it does (unless ``math_on_cuda``: a search of every kernel)."""
    dtype, where = AUTOCAST_DTYPES.get(precision), torch.device(device)
    picked = {torch_pick(call, where, dtype) for call in dict.fromkeys(calls)}
    math_timed = (math_on_cuda or where.type != "cuda") and math_fits(calls, where, dtype)
    return [k for k in kernels_taking(calls, where, dtype) if picked != {k} and (math_timed or k != "math")]


# -- timing the kernels on the model's own calls (runtime/kernel_check.py, as a run goes; the tune's search) -------

GIVE_UP = 3.0  # a kernel this much slower than torch's pick on its first pass is not timed further
MATH_SHARE = 0.25  # math attention is left out where the attention weights it keeps would take this share of the free


@contextlib.contextmanager
def recording() -> Iterator[list[AttentionCall]]:
    """Record, into the list yielded, the attention calls made inside (every one, repeats included)."""
    recorder = _Recorder()
    with recorder:
        yield recorder.calls


def time_kernels(
    calls: Sequence[AttentionCall],
    device: torch.device,
    kernels: Sequence[str | None],
    *,
    repeats: int = 3,
    budget_s: float | None = None,
) -> dict[str | None, float]:
    """Seconds the calls take, forward and backward, on each kernel (None: torch's pick, timed first), on random
    inputs of the calls' shapes and dtypes: each distinct call once per pass, counted as often as it was made; the
    fastest of ``repeats`` passes after one that warms up. A kernel whose warm-up pass takes over ``GIVE_UP`` times the
    first kernel's is not timed further (it cannot win). The random streams are put back, and autocast is off inside
    (the calls' dtypes are those autocast gave them).

    With ``budget_s``, no pass starts that would end past it (each is taken to cost what the last one did, input
    making included, and a new kernel's warm-up up to ``GIVE_UP`` times that): a kernel left without a timed pass is
    left out of the result."""
    sync, counts = device_sync(device), Counter(calls)
    timed: dict[str | None, float] = {}
    saved = capture_rng()
    began, last = time.perf_counter(), [0.0]  # the wall time of the last pass

    def affordable(passes: float = 1.0) -> bool:  # whether ``passes`` more passes like the last one end in time
        return budget_s is None or time.perf_counter() - began + passes * last[0] <= budget_s

    def one_pass() -> float:
        total, opened = 0.0, time.perf_counter()
        for call, count in counts.items():
            start = time.perf_counter()
            _run(call, device)
            sync()
            total += (time.perf_counter() - start) * count
        last[0] = time.perf_counter() - opened
        return total

    try:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            for kernel in kernels:
                if not affordable(GIVE_UP):  # a new kernel's warm-up may take GIVE_UP passes before it is let go
                    break
                with prefer_kernel(kernel) if kernel is not None else contextlib.nullcontext():
                    warm = one_pass()
                    first = next(iter(timed.values()), None)
                    if first is not None and warm > GIVE_UP * first:
                        timed[kernel] = warm
                        continue
                    passes: list[float] = []
                    while len(passes) < repeats and affordable():
                        passes.append(one_pass())
                    if passes:
                        timed[kernel] = min(passes)
    finally:
        restore_rng(saved)
    return timed


def _run(call: AttentionCall, device: torch.device) -> None:
    inputs = call.tensors(device, grad=True)
    out = TORCH_SDPA(**inputs, dropout_p=call.dropout_p, is_causal=call.is_causal, enable_gqa=call.enable_gqa)
    out.backward(torch.ones_like(out))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type`` now (None: autocast is off)."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
