"""Micro-batch axis: run each batch whole, split it into micro-batches of N, or halve it on out-of-memory.

The gradients of the micro-batches are accumulated, each loss weighted by its share of the batch,
so the optimizer step sees the batch's gradient (exactly, for a model without batch-dependent
layers such as BatchNorm). How the ranks of a distributed run synchronise them is said here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from redline.errors import ConfigError, invalid
from redline.plan import Choice

MicroBatch = int | Literal["auto"] | None

_SYNC = {
    "ddp": "; DDP: the gradients are all-reduced in the last micro-batch's backward, overlapped with it",
    "fsdp": "; FSDP: the gradients are reduced in the last micro-batch's backward",
}
_AUTO_SYNC = {  # a rank out of memory mid-backward must not leave the others waiting in a collective
    "ddp": "; DDP: the micro-batches run without gradient sync, the ranks agree whether any ran out of memory, "
    "then the gradients are all-reduced once per batch, after the backward rather than overlapped with it",
}


def check_micro_batch(value: object) -> MicroBatch:
    """Return ``value`` as a micro-batch request (the command line's text "8" becomes 8), or say what is allowed."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if value is None or value == "auto":
        return value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise invalid("micro_batch", value, "'auto', a positive number of samples, or None", "e.g. --micro-batch auto")
    return value


def resolve_micro_batch(requested: MicroBatch, *, strategy: str | None = None) -> Choice[int | str | None]:
    """Say how each batch runs; ``strategy`` (once known) adds how its gradients are synchronised."""
    if requested == "auto" and strategy == "fsdp":
        raise ConfigError(
            "micro_batch='auto' is not supported with strategy 'fsdp': FSDP gathers and reduces in every forward "
            "and backward, so a rank that ran out of memory would leave the others waiting in a collective\n"
            "hint: pass a fixed number, e.g. --micro-batch 4 (its gradients are reduced on the last micro-batch)"
        )
    if requested is None:
        return Choice(None, "default: each batch runs whole; an out-of-memory error stops the run")
    if requested == "auto":
        return Choice("auto", "auto: the whole batch; halved on out-of-memory" + _AUTO_SYNC.get(strategy or "", ""))
    sync = _SYNC.get(strategy or "", "")
    return Choice(requested, f"requested: micro-batches of at most {requested} samples, gradients accumulated" + sync)


def after_oom(failed: Sequence[tuple[int, int]], size: int, *, strategy: str | None = None) -> Choice[int]:
    """Return the axis after "auto" halved: ``failed`` holds each (size that ran out of memory, step), oldest first."""
    return Choice(size, f"auto: {size} after out-of-memory at {_sizes(failed)}" + _AUTO_SYNC.get(strategy or "", ""))


def whole_again(failed: Sequence[tuple[int, int]], step: int, *, strategy: str | None = None) -> Choice[str]:
    """Return the axis once "auto", at one sample, turned activation checkpointing on: the batches run whole again."""
    return Choice(
        "auto",
        f"auto: the whole batch again from step {step}, its activations recomputed: after out-of-memory at "
        f"{_sizes(failed)}, "
        "even 1 sample did not fit, so activation checkpointing was turned on; halved again on out-of-memory"
        + _AUTO_SYNC.get(strategy or "", ""),
    )


def _sizes(failed: Sequence[tuple[int, int]]) -> str:
    """The sizes that ran out of memory, each with its step: "16 (step 1), 8 (step 1)"."""
    return ", ".join(f"{tried} (step {step})" for tried, step in failed)


def found_size(entry: Mapping[str, Any] | None) -> int | None:
    """Return the size a stored Plan's "auto" axis (its ``Plan.to_dict()`` entry) had halved to, or None.

    A resumed run asked for "auto" again starts from it rather than trying the sizes that failed.
    """
    if not entry or "auto: " not in str(entry.get("reason", "")):
        return None
    value = entry.get("value")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
