"""How a tune's result is cached, and how a tune a signal stopped ends (``TuneInterrupted``): what it measured is
cached, unless the cache holds a tune of the same workload and run length that measured more."""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence

from torch import nn

from redline.errors import StoppedBySignal, few
from redline.hardware.device import DeviceFacts
from redline.runtime.tuned import TunedPlan, measured_more, store_tuned

log = logging.getLogger("redline")


def cache_tune(
    tuned: TunedPlan, fingerprint: str, facts: DeviceFacts, model: nn.Module, interrupted: str, signum: int
) -> str:
    """Cache ``tuned`` (under ``model``'s fingerprint too, for a bare ``Runtime(plan="tuned")``); return where. A search
    a signal stopped (at axis ``interrupted``) raises ``TuneInterrupted`` after, and caches nothing where the cache
    holds a tune of this workload for as many planned steps that measured every axis this one did, and more; one its
    budget cut short replaces such a tune with a warning (asked for, it is the user's to make)."""
    kept = measured_more(fingerprint, facts, tuned) if interrupted or tuned.unmeasured else None
    if kept is not None and interrupted:
        raise TuneInterrupted(tuned, str(kept[1]), interrupted, tuned.unmeasured, signum, kept=kept[0])
    if kept is not None:  # cut short by its budget: asked for, so it replaces the earlier tune, said
        earlier = f"left {few(kept[0].unmeasured, 4)} to auto" if kept[0].unmeasured else "measured every axis"
        log.warning(
            "this tune, cut short by its budget, left %s to auto: it replaces the tune of %s, which %s, and "
            "--plan tuned now runs it\nhint: a larger --budget measures every axis (the budget row says how much)",
            few(tuned.unmeasured, 4), kept[0].measured_at, earlier,
        )  # fmt: skip
    path = store_tuned(fingerprint, facts, tuned, model=model)
    if interrupted:
        raise TuneInterrupted(tuned, path, interrupted, tuned.unmeasured, signum)
    return path


class TuneInterrupted(StoppedBySignal):
    """A tune a SIGINT (Ctrl-C) or SIGTERM stopped after its first axis: what it measured is cached, the axes it did
    not are left to auto; ``tuned`` and ``path`` are that Plan and its cache entry. Where the cache held a tune of the
    same workload and run length that measured more (``kept``), that one stays at ``path``; ``tuned`` is not cached.
    Without an ``axis``, the signal came after the search, as its result was cached: all of it is."""

    def __init__(
        self, tuned: TunedPlan, path: str, axis: str, unmeasured: Sequence[str], signum: int = signal.SIGINT,
        *, kept: TunedPlan | None = None,
    ) -> None:  # fmt: skip
        name = signal.Signals(signum).name
        stopped = f"tune interrupted by {name} while it measured {axis}"
        hint = "run the same command again to search every axis"
        if not axis:  # after the search: every axis it measured is cached
            stopped, hint = f"tune interrupted by {name} after its search", "--plan tuned runs it"
            said = "its result was cached" + (
                f"; {few(unmeasured, 4)} left to auto, its budget spent" if unmeasured else ""
            )
        elif kept is None:
            said = f"the axes measured before it were cached, and {few(unmeasured, 4)} left to auto"
        else:
            left = f"left {few(kept.unmeasured, 4)} to auto" if kept.unmeasured else "measured every axis"
            said = f"no Plan was cached: the earlier tune of {kept.measured_at}, which {left}, is kept"
        super().__init__(signum, f"{stopped}: {said}\nhint: {hint}")
        self.tuned, self.path, self.kept = tuned, path, kept
