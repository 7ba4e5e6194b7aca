"""Whether a row's compile was served from torch's on-disk compile caches, which earlier processes filled.

A bench clears torch.compile's in-process cache before it times compiles, but inductor keeps its FX
graphs, AOTAutograd graphs and kernels on disk (``TORCHINDUCTOR_CACHE_DIR``, default
``/tmp/torchinductor_$USER``) from one process to the next: a graph compiled before loads in a fraction
of its cold compile (digits on a 2-core CPU: 0.25 s, against 4.1 s and 5.9 s in fresh folders). The
next run on this machine pays that warm compile too; a machine that never compiled the model pays the
cold one. So a compiled row says which it measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from redline.runtime.tuned import Candidate, Trial

# torch's counters of its on-disk cache lookups (torch._dynamo.utils.counters; named so from torch 2.4 on)
HITS = (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"))
MISSES = (
    ("inductor", "fxgraph_cache_miss"),
    ("inductor", "fxgraph_cache_bypass"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_bypass"),
)
Lookups = tuple[int, int]  # (hits, misses) of the on-disk caches in this process so far


def cache_lookups() -> Lookups | None:
    """The hits and misses of torch's on-disk compile caches in this process so far; None where torch keeps no
    such counters."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # a torch without dynamo: nothing compiles, nothing to tell
        return None
    return count_lookups(counters)


def count_lookups(counters: Mapping[str, Mapping[str, int]]) -> Lookups:
    """The hits and misses in torch's ``counters`` (a name torch drops counts as none)."""

    def total(names: tuple[tuple[str, str], ...]) -> int:
        return sum(int(counters.get(group, {}).get(name, 0)) for group, name in names)

    return total(HITS), total(MISSES)


def served_from_cache(before: Lookups | None, after: Lookups | None) -> bool | None:
    """Whether the compiles between two ``cache_lookups()`` were served from the on-disk caches, in part at least:
    True where a graph was (the seconds are less than a cold compile's), False where every lookup missed, None
    where torch said nothing (no counters, its caches turned off, or nothing compiled)."""
    if before is None or after is None:
        return None
    hits, misses = after[0] - before[0], after[1] - before[1]
    if hits > 0:
        return True
    return False if misses > 0 else None


def charged_first(measured: Sequence[Trial], earlier: Sequence[Trial]) -> list[Trial]:
    """``measured`` (a tune's axis), each compiled trial whose graph an ``earlier`` axis measured charged the compile
    it paid then. Each axis clears torch.compile's in-process cache, but the graph its first compile wrote to the
    on-disk caches loads warm: the current best was charged 0.4 s where a new alternative paid a cold 5.6 s."""
    first: dict[Candidate, Trial] = {}
    for trial in earlier:
        if trial.candidate.compile and not trial.rejected:  # loader workers leave the graph as it is
            first.setdefault(dataclasses.replace(trial.candidate, loader_workers=None), trial)
    charged = []
    for trial in measured:
        paid = first.get(dataclasses.replace(trial.candidate, loader_workers=None)) if trial.candidate.compile else None
        if paid is not None:
            trial = dataclasses.replace(
                trial, compile_s=paid.compile_s, compile_cached=paid.compile_cached, first_compile=True
            )
        charged.append(trial)
    return charged
