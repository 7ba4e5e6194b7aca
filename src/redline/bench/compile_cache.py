"""Whether a row's compile was served from torch's on-disk compile caches, which earlier processes filled.

A bench clears torch.compile's in-process cache before it times compiles, but inductor keeps its FX
graphs, AOTAutograd graphs and kernels on disk (``TORCHINDUCTOR_CACHE_DIR``, default
``/tmp/torchinductor_$USER``) from one process to the next: a graph compiled before loads in a fraction
of its cold compile (digits on a 2-core CPU: 0.25 s, against 4.1 s and 5.9 s in fresh folders). The
next run on this machine pays that warm compile too; a machine that never compiled the model pays the
cold one. So a compiled row says which it measured.

``reset_compiler`` clears the in-process cache before a bench's or a tune's compiles are timed, after paying
torch.compile's own start-up once a process and device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence

import torch

from redline.bench.loops import quiet_failed_ops
from redline.runtime.tuned import Candidate, Trial

log = logging.getLogger("redline")

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


def reset_compiler(devices: Iterable[str] = ()) -> None:
    """Clear torch.compile's process-wide cache, so that the next compile is timed as a fresh run's; first, once a
    process and device, pay torch.compile's own start-up on ``devices`` (its compiler stack loaded and checked:
    seconds), which would otherwise fall on whichever compiled row or candidate came first and make every later
    one look 10-20x cheaper to compile."""
    for device in devices:
        if device not in _STARTED:
            _STARTED.add(device)
            # a compiler that cannot run here fails the rows, with its reason; quiet as a warm-up is (a Ctrl-C's too)
            with contextlib.suppress(Exception), quiet_failed_ops():
                x = torch.ones(2, device=device, requires_grad=True)  # a forward and backward, as a training step's
                torch.compile(_doubled, dynamic=False)(x).sum().backward()
    try:
        from torch import _dynamo

        _dynamo.reset()
    except Exception as exc:  # only a cache: a failure costs a recompile at most
        log.debug("torch._dynamo.reset() failed: %s", exc)


_STARTED: set[str] = set()  # the devices whose compiler start-up this process has paid


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2
