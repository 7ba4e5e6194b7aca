"""The dynamic batching decision, as a pure function of the queue and the time.

    decision = decide(queue, now, max_batch_size=32, max_wait=0.005)
    decision.expired     # indices of requests past their deadline: answer 504, never run them
    decision.run         # indices of the requests to run together now (empty: wait)
    decision.wait_until  # when to decide again if nothing arrives before (None: the queue is empty)
    bucket_sizes(32)     # the padded batch sizes an engine runs: (1, 2, 4, 8, 16, 32)

The wait starts at the arrival of the oldest live request, not when the worker looks at the queue:
a timer started at dequeue (TorchServe, LitServe) lets a request that arrived during the previous
batch wait up to twice the delay, as their batchers' own code reads. The batch
size is counted in samples, and a request is never split across batches: requests are taken in
arrival order while they fit. A request larger than ``max_batch_size`` is refused before it is
queued; should one reach the queue anyway, it runs alone rather than block the queue forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redline.config import positive_int
from redline.errors import invalid


@dataclass(frozen=True)
class Pending:
    """A queued request as the batcher sees it: its samples, and when it arrived and must be answered by."""

    samples: int
    arrived: float  # seconds, on the same clock as ``now``
    deadline: float


@dataclass(frozen=True)
class Decision:
    """What to do now: drop ``expired``, run ``run`` together, or else decide again at ``wait_until``."""

    run: tuple[int, ...] = ()
    expired: tuple[int, ...] = ()
    wait_until: float | None = None


def decide(queue: Sequence[Pending], now: float, *, max_batch_size: int, max_wait: float) -> Decision:
    """Return which queued requests to drop as expired and which to run together now, or when to look again.

    A batch runs now when it is full (``max_batch_size`` samples, or the next request would not
    fit), when the oldest live request has waited ``max_wait``, or when waiting longer would take a
    request of the batch past its deadline. Otherwise nothing runs and ``wait_until`` says when the
    oldest request's wait ends.
    """
    expired = tuple(i for i, pending in enumerate(queue) if pending.deadline <= now)
    live = [i for i in range(len(queue)) if queue[i].deadline > now]
    if not live:
        return Decision(expired=expired)
    batch: list[int] = []
    samples = 0
    for i in live:
        if batch and samples + queue[i].samples > max_batch_size:
            break
        batch.append(i)
        samples += queue[i].samples
    full = samples >= max_batch_size or len(batch) < len(live)
    # Queue order is not arrival order: a request's arrival is taken before its body is read.
    ready_at = min(queue[i].arrived for i in live) + max_wait
    if full or now >= ready_at or any(queue[i].deadline <= ready_at for i in batch):
        return Decision(run=tuple(batch), expired=expired)
    return Decision(expired=expired, wait_until=ready_at)


def bucket_sizes(max_batch_size: int, requested: Sequence[int] | str = "auto") -> tuple[int, ...]:
    """Return the padded batch sizes: powers of two below ``max_batch_size``, and it; or those given."""
    positive_int("max_batch_size", max_batch_size)
    if requested == "auto":
        powers = [1 << k for k in range(max_batch_size.bit_length()) if 1 << k < max_batch_size]
        return (*powers, max_batch_size)
    if isinstance(requested, str) or not requested:
        raise invalid("batch_buckets", requested, "'auto' or batch sizes", "e.g. batch_buckets=(1, 8, 32)")
    bad = [s for s in requested if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    sizes: list[int] = sorted({s for s in requested if s not in bad})
    if bad:
        hint = f"drop {', '.join(map(repr, bad))}" + (f", keeping {', '.join(map(str, sizes))}" if sizes else "")
        raise invalid("batch_buckets", requested, "positive whole batch sizes", hint)
    if sizes[-1] != max_batch_size:
        largest, above = sizes[-1], [str(size) for size in sizes if size > max_batch_size]
        add = "" if max_batch_size in sizes else f"add {max_batch_size} as the largest size"
        drop = f"drop {', '.join(above)} (above max_batch_size={max_batch_size})" if above else ""
        fix = " and ".join(part for part in (drop, add) if part)
        hint = f"{fix}, or pass max_batch_size={largest} to make it the largest"
        raise invalid(
            "batch_buckets", requested, f"positive sizes, the largest equal to max_batch_size={max_batch_size}", hint
        )
    return tuple(sizes)


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """Return the smallest bucket that holds ``size`` samples (``size`` at most the largest bucket)."""
    return next(b for b in buckets if b >= size)
