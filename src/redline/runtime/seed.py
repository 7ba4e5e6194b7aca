"""Seeding every random number generator a run draws from, and capturing and restoring their states."""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import numpy as np
import torch

P = ParamSpec("P")
R = TypeVar("R")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def warn_seeded_late(seed: int) -> None:
    """Warn that ``seed`` was applied when ``setup()`` started the Runtime, after the model it sets up was built."""
    logging.getLogger("redline").warning(
        "seed=%d was applied when setup() started the Runtime, after this model was built: its initial "
        "weights did not come from the seed\nhint: build the model inside `with Runtime(seed=...) as rt:` "
        "(or after rt.start())",
        seed,
    )


def capture_rng() -> dict[str, Any]:
    """Return every RNG state a run draws from, in types that load with ``torch.load(weights_only=True)``."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached": cached},
        "torch": torch.get_rng_state(),
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    elif torch.cuda.is_available():  # CUDA will seed itself from this when it starts: it has drawn nothing yet
        state["cuda_seed"] = torch.initial_seed()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the RNG states ``capture_rng`` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached"])))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        # One state per GPU the capture saw: a run resumed on a machine with fewer restores those it has
        # (torch would fail on the first ordinal past them), and one with more leaves the rest as they are.
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"][: torch.cuda.device_count()]])
    elif "cuda_seed" in state and torch.cuda.is_available():  # queued until CUDA starts, if it has not
        torch.cuda.manual_seed_all(int(state["cuda_seed"]))  # started since the capture: back to its first draw


def keeps_rng(function: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``function`` so that every RNG state it moves is put back when it returns or raises.

    For a function that seeds torch for its own repeatable draws: the caller's streams go on as if it had not run.
    """

    @functools.wraps(function)
    def kept(*args: P.args, **kwargs: P.kwargs) -> R:
        saved = capture_rng()
        try:
            return function(*args, **kwargs)
        finally:
            restore_rng(saved)

    return kept
