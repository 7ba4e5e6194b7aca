"""A model hook that holds what it calls weakly, and that a copy of the model does not carry (``WeakHook``).

The run's checks (the layout's, runtime/layout.py; the precision's, runtime/precision_check.py) hook the user's
model for a few steps. A hook that is a bound method holds its check, and through it the Runtime: a
``copy.deepcopy`` or a pickle of the model taken then (a best model kept, an EMA's copy) would copy the Runtime
too, or fail on what it holds. ``WeakHook`` calls its owner's method while the owner lives, and a copy of the
model gets a hook that does nothing in its place: the copy was made outside the checks' steps. A model the user
compiles (``torch.compile(model)`` after setup) runs the hook eagerly: dynamo would trace its probe forwards and fail.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


class WeakHook:
    """A hook that calls ``owner``'s method ``name`` while ``owner`` lives (holding it weakly), and nothing after; a
    copy of it, by ``copy.deepcopy`` or pickling, is ``unchecked``."""

    def __init__(self, owner: object, name: str) -> None:
        self._owner, self._name = weakref.ref(owner), name

    @torch.compiler.disable  # a model the user compiled runs its checks eagerly: dynamo traces no probe forward
    def __call__(self, *args: Any) -> Any:
        owner = self._owner()
        return getattr(owner, self._name)(*args) if owner is not None else None

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return unchecked

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _unchecked, ()


def unchecked(*args: Any) -> None:
    """What a copy of a model being checked gets in a check's place: nothing."""
    return None


def _unchecked() -> Callable[..., None]:
    return unchecked
