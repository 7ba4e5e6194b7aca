"""The axes `redline tune` searches for a Task on a device, and why it leaves the others out.

An alternative that cannot win here is not tried (channels_last without a convolution, loader workers for data
already in memory, CUDA graphs off CUDA, a reduced precision the device has no fast arithmetic for), nor one a run
would not take (``refused_split``: micro-batches that would not train as whole batches do).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from redline.hardware.device import DeviceFacts
from redline.plan.attention import KERNELS
from redline.plan.layout import has_conv2d
from redline.plan.loader import resolve_loader
from redline.plan.precision import fast_precisions
from redline.runtime.attention import AttentionCall
from redline.runtime.loading import loader_facts
from redline.runtime.tuned import MICRO_BATCHES, Candidate
from redline.runtime.tuned_run import split_differs
from redline.task import Task


def search_space(
    task: Task, facts: DeviceFacts, *, calls: Sequence[AttentionCall] = (), skipped: dict[str, str] | None = None
) -> list[tuple[str, list[Any]]]:
    """The axes worth measuring for this task on this device, each with the values to try; ``calls`` are the model's
    calls to the attention function (``model_attention``): the attention kernels are searched only where it has some,
    and only those that take them in the precision chosen before (``attention_kernels``); ``skipped``: the
    ``skipped_axes`` found before (it builds the model)."""
    axes: list[tuple[str, list[Any]]] = []
    skipped = skipped_axes(task, facts, calls=calls) if skipped is None else skipped
    if "precision" not in skipped:
        axes.append(("precision", ["fp32", *fast_precisions(facts)]))
    axes.append(("compile", [False, True]))
    if "compile_mode" not in skipped:
        axes.append(("compile_mode", ["default", "reduce-overhead"]))
    if "cuda_graphs" not in skipped:
        axes.append(("cuda_graphs", [False, True]))
    if "channels_last" not in skipped:
        axes.append(("channels_last", [False, True]))
    if "attention" not in skipped:
        axes.append(("attention", ["auto", *(KERNELS if facts.type == "cuda" else ("flash", "math"))]))
    if "loader_workers" not in skipped:
        axes.append(("loader_workers", [None, *_worker_counts(task, facts)]))
    if "grad_accum" not in skipped:
        axes.append(("grad_accum", [1, 2]))
    return axes


def skipped_axes(task: Task, facts: DeviceFacts, *, calls: Sequence[AttentionCall] = ()) -> dict[str, str]:
    """The axes that cannot win for this task here, and why (``calls``: as ``search_space``'s)."""
    skipped = {}
    if facts.type not in ("cpu", "cuda"):
        skipped["attention"] = f"torch picks the attention kernel on {facts.type}"
    elif not calls:
        skipped["attention"] = "the model made no call to F.scaled_dot_product_attention (nor nn.MultiheadAttention)"
    if not fast_precisions(facts):
        skipped["precision"] = "this device has no reduced precision faster than fp32 to try"
    if not has_conv2d(task.outline()):
        skipped["channels_last"] = "the model has no 2-d convolution"
    if isinstance(task.train_data, TensorDataset):
        skipped["loader_workers"] = "the data are tensors in memory, which index faster than workers send them"
    if task.batch_size % 2 or task.batch_size < 2:
        skipped["grad_accum"] = f"batch {task.batch_size} does not split into two equal micro-batches"
    if facts.type != "cuda":
        skipped["compile_mode"] = "CUDA graphs (reduce-overhead) need a CUDA device"
        skipped["cuda_graphs"] = "CUDA graphs need a CUDA device"
    return skipped


def _worker_counts(task: Task, facts: DeviceFacts) -> list[int]:
    """The loader worker counts to time against the device's rule, leaving out the count the rule itself resolves to
    (on a CPU it keeps the loader's 0 workers, and 0 timed against itself "won" 4.60x once, by noise).

    A stream is read through one worker at most: more would each read the whole of it (a plain DataLoader gives every
    sample once per worker, and the Trainer's split keeps one worker's share of each), so its time is not the run's.
    """
    stream = isinstance(task.train_data, IterableDataset)
    most = 1 if stream else max(1, min(8, facts.cpu_count // 2))
    rule = resolve_loader(loader_facts(DataLoader(task.train_data, batch_size=task.batch_size)), facts).value
    return [count for count in dict.fromkeys((0, most)) if count != rule.num_workers]


def refused_split(task: Task, best: Candidate, parts: int, *, max_steps: int | None = None) -> str:
    """Why ``best`` with each batch split into ``parts`` micro-batches is not tried: the run the tune's "use it" line
    prints (`redline train --plan tuned`: the task's epochs, or ``--max-steps max_steps``) would not take them, as
    split it would not train as on whole batches (runtime/tuned_run.py, train's rule). "" where it would take them."""
    epochs = task.epochs if max_steps is None else math.inf  # as `train --max-steps N`: no end of epochs ends it
    why = split_differs(task, task.batch_size, parts, 1, epochs=epochs, max_steps=max_steps, drop_last=best.compile)
    if not why:
        return ""
    run = f"the task's {task.epochs:g} epoch(s)" if max_steps is None else f"--max-steps {max_steps}"
    return (
        f"one batch per step kept, {parts} {MICRO_BATCHES} not tried: `redline train --plan tuned` would not take "
        f"them, as for {run} they would not train as whole batches do ({why})"
    )
