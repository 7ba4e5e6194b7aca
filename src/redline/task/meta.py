"""A model built on the meta device: every shape and dtype of the real one, and no memory for its weights.

A factory often moves its model where it will train (``.to(device)``, ``.cuda()``, ``.cpu()``). On the meta
device such a move would copy out of a tensor that holds no data, and under a fake mode torch cannot swap a
fake parameter for its moved copy; so while the factory runs, a move leaves a meta tensor where it is and
applies only what else it asks (a dtype, a memory format). A tensor made on a device of its own
(``nn.Linear(..., device="cuda")``, ``torch.zeros(..., device="cuda")``) is made on meta too: a machine
without that device could not make it. A real tensor that meets a meta one (a lazy layer's first forward on a
sample of the data, which gives it its shapes) is taken as an empty meta tensor of its shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only


def on_meta(build: Callable[[], nn.Module]) -> nn.Module | None:
    """The model ``build`` makes, built on the meta device, moves kept there; None where it cannot be built so (a
    factory that reads a tensor's values, or loads weights into a real tensor): its caller builds it another way."""
    try:
        with torch.device("meta"), _MovesStayOnMeta():
            return build()
    except Exception:  # a mistake of the factory's own raises again where its caller builds it
        return None


_MOVES: frozenset[Callable[..., Any]] = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu})


class _MovesStayOnMeta(TorchFunctionMode):
    """Keep meta tensors on the meta device through ``.to``, ``.cuda`` and ``.cpu``; a dtype or memory format
    that ``.to`` asks for still applies."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _elsewhere(kwargs.get("device")):  # made on a device (nn.Linear(..., device="cuda")): made on meta instead
            return func(*args, **{**kwargs, "device": "meta"})
        tensor = args[0] if args else None
        if func not in _MOVES:  # a real tensor beside a meta one (a lazy layer's first forward on a real sample)
            return func(*_on_meta_beside_meta(args), **_on_meta_beside_meta(kwargs))
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
            return func(*args, **kwargs)
        if func is not torch.Tensor.to:
            return tensor
        _, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
        if dtype is None and memory_format is None:
            return tensor
        return tensor.to(dtype=dtype or tensor.dtype, memory_format=memory_format or torch.preserve_format)


def _on_meta_beside_meta(tree: Any) -> Any:
    """``tree`` with its real tensors made empty meta ones where it holds a meta tensor too: an op between them
    would fail on the devices' mismatch, where on meta its result has the same shape and dtype."""
    leaves = [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]
    if not any(leaf.is_meta for leaf in leaves) or all(leaf.is_meta for leaf in leaves):
        return tree
    return tree_map_only(torch.Tensor, lambda t: t if t.is_meta else torch.empty_like(t, device="meta"), tree)


def _elsewhere(device: object) -> bool:
    """Whether a ``device=`` argument names a device other than meta ("cuda", torch.device("cuda", 1), 0)."""
    if not isinstance(device, str | int | torch.device):
        return False
    try:
        return torch.device(device).type != "meta"
    except (RuntimeError, TypeError):  # not a device: the call raises its own error
        return False
