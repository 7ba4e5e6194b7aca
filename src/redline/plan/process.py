"""The process-wide axes a run asks for: deterministic algorithms and the seed (reasons only: no facts to weigh)."""

from __future__ import annotations

from redline.plan import Choice


def resolve_deterministic(requested: bool) -> Choice[bool]:
    """Say what ``deterministic`` does for the run."""
    if requested:
        return Choice(True, "requested: torch.use_deterministic_algorithms(True) while the run lasts")
    return Choice(False, "default: torch picks the fastest kernels, some of them nondeterministic")


def resolve_seed(seed: int | None) -> Choice[int | None]:
    """Say what ``seed`` does for the run."""
    if seed is None:
        return Choice(None, "not set: the RNGs are left as they are (the Trainer's data order uses 0)")
    return Choice(seed, "requested: Python, NumPy and torch seeded when the run starts")
