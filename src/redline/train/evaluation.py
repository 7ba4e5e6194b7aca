"""Evaluating a model on a Task's validation data, and predicting its outputs for any data."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import numbers
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from redline.config import positive_int
from redline.errors import PEER_STOPPED, TaskError, describe_error, invalid
from redline.parallel.collectives import all_reduce_max, all_reduce_sum, peers_said, share_buffers
from redline.parallel.env import DistEnv
from redline.runtime.contract import check_loss, describe, metric_value, split_batch, user_code
from redline.runtime.loading import read_batches
from redline.runtime.oom import is_oom
from redline.runtime.runtime import Runtime
from redline.runtime.samples import count_batch
from redline.runtime.seed import capture_rng, restore_rng
from redline.task import Task
from redline.task.definition import is_array
from redline.train.data import eval_loader, is_stream
from redline.train.failures import EvaluationOutOfMemory
from redline.train.state import Run

log = logging.getLogger("redline")


def summed_on(device: torch.device) -> torch.device:
    """Where the ranks' evaluation sums are reduced: a CUDA run's device (NCCL reduces no CPU tensor), else the CPU
    (gloo reduces CPU tensors, and MPS has no float64)."""
    return device if device.type == "cuda" else torch.device("cpu")


@torch.no_grad()
def evaluate_model(
    task: Task,
    model: nn.Module,
    rt: Runtime,
    batch_size: int,
    env: DistEnv | None = None,
    *,
    where: str = "evaluation",
    batches: int | None = None,
) -> dict[str, float | None]:
    """Return the mean validation loss and metric, weighting each batch by its size.

    Under several processes each rank evaluates its own contiguous shard, in batches of ``batch_size`` (its
    share of a training batch), with rank 0's buffers (BatchNorm's running statistics), and the sums are added
    over the ranks, so every sample counts exactly once. Every rank runs as many forwards (``_in_step``). A
    compiled model evaluates through its own (eager) forward, under the run's autocast: a partial last batch
    would otherwise compile again. ``where`` starts an error's message; ``batches`` bounds each rank's batches.
    """
    env = env or DistEnv()
    assert task.val_data is not None
    total_loss, total_metric, count = 0.0, 0.0, 0
    loss_sum: torch.Tensor | float = 0.0  # summed where the losses are: one sync at the end, not one a batch
    # a rank that stopped first breaks the sums' all-reduce (or FSDP's gathers in the forward): said as a step says it
    with peers_said(where, PEER_STOPPED), _eval_mode(model), _out_of_memory(where, batch_size):
        share_buffers(model)  # FSDP keeps each rank's own; the model evaluated is rank 0's, as a checkpoint holds it
        val = eval_loader(
            task.val_data, batch_size=batch_size, rank=env.rank, world_size=env.world_size, collate_fn=task.collate_fn
        )
        collate = task.collate_fn or default_collate  # what a batch that is no pair is blamed on
        for batch, counted in _in_step(task, val, env, summed_on(rt.device), batches):
            inputs, targets = split_batch(rt.to_device(batch), "val_data", collate_fn=collate)
            with rt.eager(), rt.autocast(), user_code(where, inputs, targets, data="val_data") as forward:  # eager
                outputs = forward.outputs = model(inputs)
                if not counted:
                    continue
                loss = check_loss(task.loss_fn(outputs, targets), training=False)
            with user_code(where, outputs, targets, metric=True):
                metric = metric_value(_numpy_read(task.metric(outputs, targets))) if task.metric is not None else 0.0
            n = count_batch(inputs, targets)
            loss_sum = loss_sum + loss.detach().to(_summed_dtype(loss.device)) * n
            total_metric += metric * n
            count += n
    total_loss = float(loss_sum)
    # In float64: a metric of 0.6 on every batch reads 0.6, and a count past 2**24 samples stays exact.
    sums = torch.tensor([total_loss, total_metric, float(count)], dtype=torch.float64, device=summed_on(rt.device))
    with peers_said(where, PEER_STOPPED):
        total_loss, total_metric, count = all_reduce_sum(sums).tolist()
    if count == 0:  # every rank knows: the count is the job's total
        raise TaskError(
            f"{where}: val_data gave no item, so there is no validation loss to report: the stream is empty, or "
            "its __iter__ returns the same iterator each time, used up by the first pass\nhint: make val_data's "
            "__iter__ start a fresh pass each time it is called (write it as a generator, with yield)"
        )
    return {"val_loss": total_loss / count, "val_metric": total_metric / count if task.metric else None}


def _summed_dtype(device: torch.device) -> torch.dtype:
    """The dtype the batches' losses are summed in: float64, as a Python float adds them, where the device has it."""
    return torch.float32 if device.type == "mps" else torch.float64


def check_val_data(task: Task, run: Run, batch_size: int, env: DistEnv) -> None:
    """Evaluate val_data's first batch (``batch_size`` a rank) after the ``run``'s first step, so that a mistake in
    val_data, or in the loss or the metric on it, stops the run then, not at its first evaluation, after the training
    before it (after a step, not before: a model or loss that fails on train_data too is told of as the step's own
    failure). Nothing is logged, the time is left out of the step rates, and the random streams are put back (a
    metric that draws leaves the run as it would have been). A stream is not checked: one whose passes read one
    source (a file it holds open, an iterator it keeps) would miss the batch read from its first evaluation."""
    if task.val_data is None or is_stream(task.val_data):
        return
    run.beat("val_data's first batch")
    where, saved = f"val_data's first batch, after step {run.pos.step}", capture_rng()
    try:
        with run.meter.excluded("eval"):
            evaluate_model(task, run.model, run.rt, batch_size, env, where=where, batches=1)
    finally:
        restore_rng(saved)


def _in_step(
    task: Task, loader: Any, env: DistEnv, device: torch.device, limit: int | None = None
) -> Iterator[tuple[Any, bool]]:
    """Yield this rank's batches of ``loader`` (its first ``limit`` where given), each with True, then padding
    batches, each with False (not counted), until every rank has run as many forwards.

    Under FSDP every forward gathers the parameters, and DDP's broadcasts a model's buffers: a rank with fewer
    batches (a shard one item shorter, or none at all) left the others waiting in their next forward. A padding
    batch is the rank's last batch again, or, where it had none, val_data's first item. The ranks agree once on
    the largest number of batches of a map-style dataset, and before each batch whether any rank has one of a
    stream.
    """
    batches = read_batches(loader)  # an error in the dataset shows the user's line
    if not env.distributed:
        yield from ((batch, True) for batch in itertools.islice(batches, limit))
        return
    assert task.val_data is not None
    largest = None if is_stream(task.val_data) else all_reduce_max(len(loader), device)
    last = None
    for index in itertools.count():
        if (largest is not None and index >= largest) or (limit is not None and index >= limit):
            return
        batch = next(batches, None)
        if largest is None and not all_reduce_max(int(batch is not None), device):
            return
        if batch is not None:
            last = batch
            yield batch, True
            continue
        last = last if last is not None else _first_item(task, env)
        yield last, False


def _first_item(task: Task, env: DistEnv) -> Any:
    """val_data's first item as a batch: the padding forward of a rank whose share of val_data is empty."""
    assert task.val_data is not None
    first = next(read_batches(eval_loader(task.val_data, batch_size=1, collate_fn=task.collate_fn)), None)
    if first is None:  # a stream that yields each rank its own share yielded this one none
        raise TaskError(
            f"evaluation: val_data yielded rank {env.rank} no item while another rank's share has some, and every rank "
            "runs as many forwards (a sharded model's forward gathers its weights from every rank)\nhint: have "
            "val_data's __iter__ yield each rank at least one item"
        )
    return first


@contextlib.contextmanager
def _out_of_memory(where: str, batch_size: int) -> Iterator[None]:
    """An out-of-memory while evaluating is an OutOfMemory that says so (it ended the run with torch's traceback)."""
    try:
        yield
    except Exception as exc:
        if not is_oom(exc):
            raise
        raise EvaluationOutOfMemory(
            f"{where}: the device ran out of memory: {describe_error(exc)}\nhint: evaluation runs val_data in batches "
            f"of {batch_size} without gradients, less than a training step holds: larger samples in val_data than in "
            "train_data, or outputs a loss_fn or metric keeps, take the rest; --micro-batch does not split evaluation"
        ) from exc


def _numpy_read(value: Any) -> Any:
    """A metric's NumPy result as torch would read it: a scalar (np.float32's mean of an array) as a float, an
    array as a tensor (one element is one number); anything else as it came, for metric_value to judge."""
    if type(value).__module__ != "numpy" or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Real):  # np.float16/32/64 and the integer scalars; np.bool_ is no number
        return float(value)
    kind = getattr(getattr(value, "dtype", None), "kind", "")
    return torch.as_tensor(value) if kind in ("f", "i", "u") else value  # an array of numbers; of bools, as it came


@torch.no_grad()
def predict_outputs(model: nn.Module, rt: Runtime, data: Any, batch_size: int, task: Task | None = None) -> Any:
    """Return ``model``'s outputs for ``data`` (a Dataset of inputs or of (inputs, targets)), on CPU.

    A model that returns a tensor gives one tensor; one that returns a tuple, list or dict of them
    (logits and a hidden state, say) gives the same structure, each tensor holding every batch; a dataclass
    (Hugging Face's ModelOutput) gives a dict of its fields that are not None. A tensor of shape () in such a
    structure (a loss computed inside forward, next to per-sample logits) is one number for its batch: it is left
    out (a namedtuple's field is None), and a log line names it.
    Floating-point outputs come back as float32; integer ones (token ids) keep their dtype.
    The ``task``'s collate_fn batches the items, as in training, unless they are bare inputs where the Task's
    data holds other items (``_bare_inputs``): a tensor or array each, or ``(inputs,)`` (``((a, b),)``), which
    are stacked as a DataLoader stacks them, as a collate_fn written for the Task's items could not read them.
    Outputs that differ in shape beyond the batch axis from one batch to the next cannot be joined: a TaskError
    says so at that batch.
    """
    positive_int("batch_size", batch_size)  # 0 is no batch, not "the default"
    outputs: list[Any] = []
    first: dict[str, tuple[int, ...]] | None = None  # the first batch's output shapes
    left_out: list[str] = []  # the places of the outputs with no batch axis
    collate_fn, hint = task.collate_fn if task is not None else None, ""
    if task is not None and collate_fn is not None:
        kinds = _task_item_kinds(task)
        if _bare_inputs(data, kinds):
            collate_fn, hint = None, _predict_bare_hint(kinds)
        else:
            hint = _predict_collate_hint(kinds)
    with _eval_mode(model):
        for batch in read_batches(eval_loader(data, batch_size=batch_size, collate_fn=collate_fn), hint):
            pair = isinstance(batch, list | tuple)  # (inputs, targets), or (inputs,): items of several inputs nest
            inputs, rest = (batch[0], batch[1] if len(batch) > 1 else None) if pair else (batch, None)
            with user_code("predict", inputs, rest), rt.autocast(), rt.eager():  # the user's line, if it raises
                output = _per_sample(_on_cpu(model(rt.to_device(inputs))), left_out)
            if first is None and left_out:
                _say_left_out(left_out, _shapes(output))
            first = _check_joinable(_shapes(output), first, len(outputs) + 1)
            outputs.append(output)
    if not outputs:
        raise invalid("len(data)", 0, "at least one item to predict", "check how the data is built: it is empty")
    return _joined(outputs)


def _predict_collate_hint(kinds: list[str]) -> str:
    held = f", {' or '.join(kinds)}" if kinds else ""
    return (
        f"predict batches the items with the Task's collate_fn, as training does: give items as the Task's data "
        f"holds them{held}, or fix the collate_fn; REDLINE_TRACEBACK=1 prints the whole traceback"
    )


def _predict_bare_hint(kinds: list[str]) -> str:
    held = " or ".join(kinds) if kinds else "items of another kind"
    return (
        f"predict stacks bare inputs itself; the Task's collate_fn batches the items its data holds, {held}: give "
        "predict such items (with any targets) to have it batch them"
    )


def _bare_inputs(data: Any, kinds: list[str]) -> bool:
    """Whether ``data``'s items are bare inputs, to stack without the Task's collate_fn, as its first item reads:
    a tensor or array, or ``(inputs,)``, where the Task's items (their ``kinds``; none known: a stream) are of
    another kind. Items of the Task's kind, items of a third kind (a pair where the Task holds dicts: its collate_fn
    is asked, and its failure's hint names the Task's kind), and a stream (read only by iterating) are collated."""
    try:
        item = data[0] if len(data) else None
    except Exception:  # no __getitem__ or __len__, or an index it refuses
        return False
    if item is None or _item_kind(item) in kinds:
        return False  # no item (predict refuses the empty data by its length), or one the Task's collate_fn reads
    return is_array(item) or (isinstance(item, tuple | list) and len(item) == 1)


def _task_item_kinds(task: Task) -> list[str]:
    """The kinds of item the Task's train_data and val_data hold, as their first items read (a stream's unread)."""
    kinds: list[str] = []
    for data in (task.train_data, task.val_data):
        if data is None or isinstance(data, IterableDataset):
            continue
        try:
            kind = _item_kind(data[0])
        except Exception:  # the dataset's own code; training reads it again, and says so where it fails
            continue
        if kind not in kinds:
            kinds.append(kind)
    return kinds


def _item_kind(item: Any) -> str:
    """What kind of item ``item`` is, in words (plural): a collate_fn reads the items of one kind alike."""
    if isinstance(item, Mapping):
        return f"dicts of {', '.join(sorted(repr(key) for key in item))}"
    if isinstance(item, tuple | list):
        return "(inputs, targets) pairs" if len(item) == 2 else f"tuples of {len(item)}"
    return "tensors or arrays" if is_array(item) else f"{type(item).__name__} items"


def _per_sample(output: Any, left_out: list[str], place: str = "output") -> Any:
    """``output`` (on the CPU) without the tensors of shape () inside it, their places added to ``left_out`` (once):
    a loss a model computes in forward is one number for the batch, with no batch axis to join the batches' along.
    A namedtuple keeps None in such a field; an output that is one such tensor stays, for _check_joinable to refuse."""
    if isinstance(output, torch.Tensor) or output is None:
        return output
    parts = output.items() if isinstance(output, Mapping) else enumerate(output)
    kept = []
    for key, value in parts:
        where = f"{place}[{key!r}]"
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            if where not in left_out:
                left_out.append(where)
            if hasattr(output, "_fields"):
                kept.append((key, None))
            continue
        kept.append((key, _per_sample(value, left_out, where)))
    if isinstance(output, Mapping):
        return dict(kept)
    values = [value for _, value in kept]
    return type(output)(*values) if hasattr(output, "_fields") else type(output)(values)


def _say_left_out(left_out: list[str], shapes: dict[str, tuple[int, ...]]) -> None:
    """Log the outputs left out of predict's (``left_out``), or refuse an output with nothing else to join."""
    if not shapes:
        raise TaskError(
            f"predict: the model's {' and '.join(left_out)} is a tensor of shape (), with no batch axis to join the "
            "batches' outputs along, and its output holds no other tensor\nhint: return one row per sample from "
            "forward (shape (batch, ...)), the logits, say"
        )
    log.info(
        "predict leaves out the model's %s: a tensor of shape () is one number for the whole batch (a loss computed "
        "in forward), with no batch axis to join the batches' outputs along",
        " and ".join(left_out),
    )


def _shapes(output: Any, place: str = "output") -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of a batch's ``output`` (on the CPU), by its place in the structure (None: none)."""
    if output is None:
        return {}
    if isinstance(output, torch.Tensor):
        return {place: tuple(output.shape)}
    parts = output.items() if isinstance(output, Mapping) else enumerate(output)
    return {name: shape for key, value in parts for name, shape in _shapes(value, f"{place}[{key!r}]").items()}


def _check_joinable(
    shapes: dict[str, tuple[int, ...]], first: dict[str, tuple[int, ...]] | None, batch: int
) -> dict[str, tuple[int, ...]]:
    """Refuse a batch's output (its ``shapes``) that cannot be joined along the batch axis to the first batch's
    (``first``; None: this is the first); return the first's shapes."""
    for place, shape in shapes.items():
        if not shape:
            raise TaskError(
                f"predict: the model's {place} is a tensor of shape (), with no batch axis to join the batches' "
                "outputs along\nhint: return one row per sample from forward (shape (batch, ...))"
            )
    if first is None:
        return shapes
    differ = sorted(place for place in shapes.keys() | first.keys() if _rows(shapes, place) != _rows(first, place))
    if differ:
        place = differ[0]
        raise TaskError(
            f"predict joins the batches' outputs along the batch axis, and the model's {place} in batch {batch} is "
            f"{_shape_text(shapes, place)}, in the first {_shape_text(first, place)}: outputs whose length differs "
            "from batch to batch cannot be joined\nhint: pad every batch to one length (a collate_fn that pads to a "
            "fixed length), predict in one batch (batch_size=len(data)), or run trainer.model on each batch "
            "yourself, under torch.no_grad()"
        )
    return first


def _rows(shapes: dict[str, tuple[int, ...]], place: str) -> tuple[int, ...] | None:
    """The shape beyond the batch axis of the tensor at ``place`` (None: the output has none there)."""
    return shapes[place][1:] if place in shapes else None


def _shape_text(shapes: dict[str, tuple[int, ...]], place: str) -> str:
    return f"of shape {shapes[place]}" if place in shapes else "absent"


def _on_cpu(output: Any) -> Any:
    """The model's output with each tensor on the CPU (floating point as float32), nested as it came."""
    if isinstance(output, torch.Tensor):
        return (output.float() if output.is_floating_point() else output).cpu()
    if isinstance(output, Mapping):
        return {key: _on_cpu(value) for key, value in output.items()}
    if dataclasses.is_dataclass(output) and not isinstance(output, type):  # Hugging Face's outputs, without a loss
        fields = ((field.name, getattr(output, field.name)) for field in dataclasses.fields(output))
        return {name: _on_cpu(value) for name, value in fields if value is not None}
    if isinstance(output, tuple | list):
        parts = [_on_cpu(value) for value in output]
        return type(output)(*parts) if hasattr(output, "_fields") else type(output)(parts)  # a namedtuple's fields
    raise TaskError(
        f"the model returned {describe(output)}; predict collects tensors, alone or in tuples, lists, dicts and "
        "dataclasses\n"
        "hint: return the outputs as tensors from forward (a Python number or text cannot be joined over batches)"
    )


def _joined(parts: list[Any]) -> Any:
    """The outputs of every batch joined along the batch axis, each tensor of the structure on its own."""
    first = parts[0]
    if first is None:  # a namedtuple's field of shape (), left out
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, Mapping):
        return {key: _joined([part[key] for part in parts]) for key in first}
    joined = [_joined(list(column)) for column in zip(*parts, strict=True)]
    return type(first)(*joined) if hasattr(first, "_fields") else type(first)(joined)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode inside, and back in the mode it had after, even when the user's code raised."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
