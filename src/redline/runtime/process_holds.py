"""Process-wide settings held by runs that overlap, each put back right whatever order the runs end in.

torch keeps TF32, deterministic algorithms and the attention kernels per process. A run that sets one remembers what
it found and puts that back when it ends; but runs that overlap (a notebook's second Runtime built while the first is
open, a bench's turns) need not end in the order they began. The first to end then put back what it found while the
second still ran (deterministic mode off under a run that asked for it), and the second, ending last, put back the
first's setting for good. Here each setting keeps its holds in the order they were taken: the latest hold's setting
is the process's. A hold released while a later one stands puts nothing back: it hands what it found to the hold
taken after it, which puts back both, its own first, when it ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

# each setting's holds, oldest first; a hold is the restores its release runs, its own first
_HOLDS: dict[str, list[list[Callable[[], None]]]] = {}


@contextlib.contextmanager
def hold_setting(key: str, apply: Callable[[], Callable[[], None]]) -> Iterator[None]:
    """Hold the process-wide setting ``key`` inside: ``apply()`` sets it and returns what puts back what it found."""
    holds = _HOLDS.setdefault(key, [])
    hold = [apply()]
    holds.append(hold)
    try:
        yield
    finally:
        index = next(i for i, held in enumerate(holds) if held is hold)
        del holds[index]
        if index < len(holds):  # a later hold stands: its setting stays, and it puts back what this one found
            holds[index].extend(hold)
        else:
            for restore in hold:
                restore()
