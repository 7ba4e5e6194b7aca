"""What torch.compile tells of its own work, read where it keeps it: the frames it compiled, the graphs it holds, why
it compiled a graph again, whether an error is the compiler's, and when it compiles a training graph's backward."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any


def compiled_frames() -> int:
    """How many frames torch.compile has compiled in this process: it grows by one per compile or recompile."""
    return frames("ok")


def captured_graphs() -> tuple[int, list[str]]:
    """How many graphs of ops torch.compile has captured in this process, and the graph breaks it has met (each
    reason's text): a frame it "compiled" around an op it cannot trace (an LSTM) may hold no graph at all."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return 0, []
    return int(counters["stats"]["unique_graphs"]), list(counters["graph_break"])


def frames(kind: str) -> int:
    """torch.compile's count of frames in this process: "ok" (compiled) or "total" (tried: compiled, or given up on)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return 0
    return int(counters["frames"][kind])


def graphs_held(code: Any) -> int:
    """How many graphs torch.compile holds for ``code`` (0 where torch cannot say)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(code))
    except Exception:
        return 0


# A compile after the first that no guard's failure caused: another frame of the forward compiled for the first time,
# past a graph break (under several processes, DDP's forward calls its own logging code between two graphs).
NEW_FRAME = "no guard failed: another frame of the forward, past a graph break (DDP's own code, say), compiled once"


# torch's guard for a tensor whose length changed: "tensor 'args[0]' size mismatch at index 1. expected 5, actual 7"
OTHER_AXIS_CHANGED = re.compile(r"size mismatch at index [1-9]")


def recompile_hint(cause: str) -> str:
    """A hint for a recompile's ``cause`` where its remedy is the data's (a length beyond the batch axis that
    changes from batch to batch: a collate_fn that pads each batch to its longest item), else ""."""
    if not OTHER_AXIS_CHANGED.search(cause):
        return ""
    return (
        "\nhint: a length beyond the batch axis changed from one batch to the next: pad the data to a fixed length "
        "(or a few bucket lengths) in the collate_fn, so the compiled step sees fixed shapes"
    )


def last_guard_failure(code: Any) -> str:
    """The newest reason torch gave for a recompile (a guard that failed) of ``code``, else of any frame (one past a
    graph break, whose code is a submodule's), or "" if it gave none."""
    try:
        from torch._dynamo.utils import guard_failures
    except Exception:
        return ""
    reasons = list(guard_failures.get(code, ())) or [
        reason for failures in guard_failures.values() for reason in failures
    ]
    return str(reasons[-1]).strip() if reasons else ""


@contextlib.contextmanager
def backward_with_forward() -> Iterator[None]:
    """Have torch compile a training graph's backward with its forward inside, not at its first backward (as it does
    by default), where this torch has the setting for it. A backward that fails to compile then fails the forward's
    call, which can run the model's own forward in its place, where at the backward it failed the step with the
    compiler's error. torch keeps its settings per thread (2.13 does): another thread's compiles are left as they
    were."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, LOWER_BACKWARD):
        yield
        return
    saved = getattr(functorch_config, LOWER_BACKWARD)
    setattr(functorch_config, LOWER_BACKWARD, True)
    try:
        yield
    finally:
        setattr(functorch_config, LOWER_BACKWARD, saved)


LOWER_BACKWARD = "force_non_lazy_backward_lowering"  # torch's setting (2.13 has it; older ones may not)


def is_compiler_error(exc: BaseException) -> bool:
    # Errors raised by the compiler stack itself; a user's own bug re-raises from the eager rerun.
    module = type(exc).__module__
    return module.startswith(("torch._dynamo", "torch._inductor", "torch._functorch", "torch.fx"))
