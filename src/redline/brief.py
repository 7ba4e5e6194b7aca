"""Short reprs for the result objects a notebook prints: the figures a reader looks for, one line, where the whole
dataclass (a Plan of fifteen reasons inside) printed several kilobytes; ``to_dict()`` still gives everything."""

from __future__ import annotations

from typing import Any


def brief(obj: object, names: tuple[str, ...], **more: str) -> str:
    """``Name(a=1, b=0.1235, ...)``: ``names``' values (floats to four figures), then ``more`` as written."""
    parts = [f"{name}={_said(getattr(obj, name))}" for name in names]
    parts += [f"{name}={text}" for name, text in more.items()]
    return f"{type(obj).__name__}({', '.join(parts)})"


def _said(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else repr(value)
