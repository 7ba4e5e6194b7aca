"""A torch-function mode that sees every call of ``F.scaled_dot_product_attention``, those inside
``nn.MultiheadAttention`` too.

torch lets a mode see a function such as ``F.multi_head_attention_forward`` (every ``nn.Transformer*`` layer's
attention), not what its body calls: the body runs with no mode on, and calls the attention function by F's name. So
while a mode's call of that function runs, F's name leads to ``_by_name``, which hands the call to the modes whose
windows are open on this thread, outermost first (as torch hands a call down its stack of modes), and to torch's
function after them. Another thread's call goes straight to torch's function, and F's name is put back when the last
window on any thread closes (unless something wrapped it since: its calls then reach torch's function through
``_by_name``, which finds no window open).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

TORCH_SDPA = torch._C._nn.scaled_dot_product_attention  # torch's own, whatever a profiler or a patch wraps F's name in

Attend = Callable[..., Any]  # (sdpa, *args, **kwargs): the call, and the function that runs it on


class AttentionMode(TorchFunctionMode):
    """Hands every call of the attention function to ``attend`` (those ``nn.MultiheadAttention`` makes inside too),
    and every other call to ``other``."""

    def attend(self, sdpa: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return sdpa(*args, **kwargs)

    def other(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is TORCH_SDPA or func is F.scaled_dot_product_attention:
            return self.attend(func, *args, **kwargs)
        if func is F.multi_head_attention_forward:
            _open(self.attend)
            try:
                return func(*args, **kwargs)
            finally:
                _close()
        return self.other(func, *args, **kwargs)


class _Windows(threading.local):
    def __init__(self) -> None:
        self.attends: list[Attend] = []  # this thread's open windows, outermost first


_windows = _Windows()
_lock = threading.Lock()
_state: dict[str, Any] = {"open": 0, "torchs": None}  # windows open on all threads; the name's holder before


def _by_name(*args: Any, **kwargs: Any) -> Any:
    """F's name while a window is open: this thread's modes, outermost first, then what the name held before."""
    torchs = _state["torchs"] or TORCH_SDPA
    attends = list(_windows.attends)

    def call(index: int) -> Callable[..., Any]:
        if index == len(attends):
            return torchs
        return lambda *a, **k: attends[index](call(index + 1), *a, **k)

    return call(0)(*args, **kwargs)


def _open(attend: Attend) -> None:
    with _lock:
        if _state["open"] == 0:
            _state["torchs"] = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _by_name
        _state["open"] += 1
    _windows.attends.append(attend)


def _close() -> None:
    _windows.attends.pop()
    with _lock:
        _state["open"] -= 1
        if _state["open"] == 0:
            if F.scaled_dot_product_attention is _by_name:
                F.scaled_dot_product_attention = _state["torchs"]
            _state["torchs"] = None
