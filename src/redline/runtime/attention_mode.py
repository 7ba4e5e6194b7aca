"""A torch-function mode that sees every call of ``F.scaled_dot_product_attention``, those inside
``nn.MultiheadAttention`` too.

torch lets a mode see a function such as ``F.multi_head_attention_forward`` (every ``nn.Transformer*`` layer's
attention), not what its body calls: the body runs with no mode on, and calls the attention function by F's name. So
while a mode's call of that function runs, F's name leads to ``_by_name``, which hands the call to the modes whose
windows are open on this thread, outermost first (as torch hands a call down its stack of modes), and to torch's
function after them. Another thread's call goes straight to what the name held before, and the name is put back when
the last window on any thread closes (unless something wrapped it since: its calls then reach what the name held
before through ``_by_name``, which finds no window open).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
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
            with _window(self.attend):
                return func(*args, **kwargs)
        return self.other(func, *args, **kwargs)


class _Windows(threading.local):
    def __init__(self) -> None:
        self.attends: list[Attend] = []  # this thread's open windows, outermost first


_windows = _Windows()
_lock = threading.Lock()
# windows open on all threads; what F's name held before the first (kept while something else holds the name)
_state: dict[str, Any] = {"open": 0, "torchs": None}


def _by_name(*args: Any, **kwargs: Any) -> Any:
    """F's name while a window is open: this thread's modes, outermost first, then what the name held before. Each
    mode's attend runs with the windows below it alone open, as torch runs a mode's handler with the mode off: a
    call it makes by name again goes on down, not back to it."""
    torchs = _state["torchs"]
    torchs = TORCH_SDPA if torchs is None or torchs is _by_name else torchs
    attends = list(_windows.attends)

    def call(index: int) -> Callable[..., Any]:
        if index == len(attends):
            return torchs

        def run(*a: Any, **k: Any) -> Any:
            held, _windows.attends = _windows.attends, attends[index + 1 :]
            try:
                return attends[index](call(index + 1), *a, **k)
            finally:
                _windows.attends = held

        return run

    return call(0)(*args, **kwargs)


@contextlib.contextmanager
def _window(attend: Attend) -> Iterator[None]:
    """Open a window for ``attend`` on this thread while inside. F's name leads to ``_by_name`` from the first window
    open on any thread to the last one closed; it is put back then where it still leads there (a wrapper put on it
    since keeps it, and what it held before is kept for ``_by_name`` to call)."""
    with _lock:
        if _state["open"] == 0:
            if F.scaled_dot_product_attention is not _by_name:  # else a wrapper put on it was taken off since
                _state["torchs"] = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _by_name
        _state["open"] += 1
    attends = _windows.attends
    try:
        attends.append(attend)
        yield
    finally:
        opened = [i for i, each in enumerate(attends) if each == attend]  # the last, if an interrupt let it in
        if opened:
            del attends[opened[-1]]
        with _lock:
            _state["open"] -= 1
            if _state["open"] == 0 and F.scaled_dot_product_attention is _by_name:
                F.scaled_dot_product_attention = _state["torchs"] or TORCH_SDPA
