"""Count the bytes a training step keeps alive, op by op, on fake tensors: no device memory, any model.

Under ``FakeTensorMode`` every op runs on tensors that carry a shape, a dtype and a storage size but no
data, so a 7B model's step can be traced on a laptop. ``LiveBytes`` sits under it as a dispatch mode:
each new storage an op returns is counted until Python frees it (a finaliser on the storage), so the
running total is what the allocator would hold, views and in-place ops included, and its highest
value is the step's peak. Storages are told apart afterwards by what they turned out to be:
parameters, gradients, optimizer state, and the rest (activations saved for backward, temporaries,
the batch).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Track the bytes of every live storage made under it; ``peak`` and the storages alive at the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # storage key -> bytes
        self._keys: dict[int, int] = {}  # a live storage's address -> its key (an address is reused once freed)
        self._next = 0
        self.current = 0
        self.peak = 0
        self.at_peak: dict[int, int] = {}  # the storages alive at the peak, once reset_peak asked for them
        self._snapshots = False
        self._parts: dict[int, int] = {}  # a sparse tensor's key (its values') -> its indices' key
        self.cast_from: set[int] = set()  # the keys of the tensors whose dtype copies are noted (the parameters)
        self.casts: set[int] = set()  # the keys of those copies (autocast's low-precision weights)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        keys = [self.track(leaf) for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
        if func is torch.ops.aten._to_copy.default and self._key(args[0]) in self.cast_from:
            self.casts.update(keys)
        return out

    def _key(self, tensor: torch.Tensor) -> int | None:
        """The key of ``tensor``'s storage where it is tracked and alive."""
        return self._keys.get(int(tensor.untyped_storage()._cdata)) if tensor.layout == torch.strided else None

    def track(self, tensor: torch.Tensor) -> int:
        """Count ``tensor``'s storage once, until it is freed; return its key."""
        if tensor.layout == torch.sparse_coo:  # a sparse gradient (nn.Embedding(sparse=True)): no storage of its own
            values = self.track(tensor._values())
            self._parts[values] = self.track(tensor._indices())
            return values
        storage = tensor.untyped_storage()
        address = int(storage._cdata)
        key = self._keys.get(address)
        if key is None:
            key = self._keys[address] = self._next
            self._next += 1
            size = int(storage.nbytes())
            self.live[key] = size
            self.current += size
            weakref.finalize(storage, self._free, address, key)
            if self.current > self.peak:
                self.peak = self.current
                if self._snapshots:
                    self.at_peak = dict(self.live)
        return key

    def _free(self, address: int, key: int) -> None:
        self._keys.pop(address, None)
        self.current -= self.live.pop(key, 0)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now, and from now on remember which storages the peak holds."""
        self.peak = self.current
        self._snapshots = True
        self.at_peak = dict(self.live)

    def bytes_at_peak(self, keys: Iterable[int]) -> int:
        """Bytes of the storages among ``keys`` (a sparse tensor's indices with its values) alive at the peak."""
        keys = set(keys)
        keys |= {self._parts[k] for k in keys if k in self._parts}
        return sum(self.at_peak.get(k, 0) for k in keys)


@contextmanager
def retained_by_module(model: nn.Module, tracker: LiveBytes) -> Iterator[dict[str, int]]:
    """Yield a dict that fills, per module (by name), with the bytes its forward left alive: what it saved
    for backward and its output. A module called twice counts both calls."""
    retained: dict[str, int] = {}
    starts: dict[int, list[int]] = {}
    handles = []

    def before(module: nn.Module, args: Any) -> None:  # one hook for every module: it needs no name
        starts.setdefault(id(module), []).append(tracker.current)

    def after(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            stack = starts.get(id(module))
            if stack:
                retained[name] = retained.get(name, 0) + max(tracker.current - stack.pop(), 0)

        return hook

    for name, module in model.named_modules():
        if name:  # the whole model's figure is the activations total itself
            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(after(name)))
    try:
        yield retained
    finally:
        for handle in handles:
            handle.remove()
