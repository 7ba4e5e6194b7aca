"""What `redline serve` and `redline predict` run: a model and the shape of one input sample.

A spec names a factory, as a Task spec does (``example:digits``, ``pkg.module:factory``,
``path/to/file.py:factory``). The factory returns a ``Servable``, or a Task (its model, with the
shape and dtype of its first training sample). A bare module is refused: without the input's
shape nothing can be checked before it reaches the model, nor warmed up. A Task's model is built
afresh, so without ``weights`` it is untrained unless the Task loads its own: a warning says so. The
factory and the model's building run under a fixed seed, so an untrained model answers alike on every
start (and the engine's measurements, keyed by the weights, are found in the cache on the next).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import IterableDataset

from redline.errors import ConfigError, TaskError, TaskSpecError, describe_error, invalid, user_line
from redline.runtime.contract import PAIR_HINT, describe, split_batch
from redline.serve.weights import load_weights
from redline.task import Task, find_factory, run_factory

log = logging.getLogger("redline")

UNTRAINED_SEED = 0  # a Task's model built without weights is seeded: the same untrained model on every start
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")

Preprocess = Callable[[torch.Tensor], torch.Tensor]
Postprocess = Callable[[torch.Tensor], Sequence[Any]]


@dataclass(frozen=True, kw_only=True)
class Servable:
    """A model to serve, with the shape and dtype of one input sample (the batch dimension left out).

    ``preprocess(inputs)`` turns a batch of request inputs, already checked against ``input_shape``
    and ``input_dtype`` (on the CPU), into the model's input batch with as many rows (say uint8
    pixels into normalised floats); it runs in the model's thread, before the batch is padded.
    ``postprocess(outputs)`` turns a batch of outputs (on the CPU, in float32 for a floating model)
    into one JSON-ready value per sample (numpy arrays and tensors are written as the numbers they hold);
    without it each sample's output is returned as nested lists.
    """

    model: nn.Module
    input_shape: tuple[int, ...]
    input_dtype: str = "float32"  # a torch.dtype is taken for its name
    preprocess: Preprocess | None = None
    postprocess: Postprocess | None = None
    name: str = "model"
    extra: dict[str, Any] = field(default_factory=dict)  # shown in /openapi.json's description

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise invalid("model", type(self.model).__name__, "an nn.Module", "wrap a plain function in an nn.Module")
        shape = tuple(self.input_shape) if isinstance(self.input_shape, tuple | list) else (None,)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise invalid(
                "input_shape", self.input_shape, "positive integers, one sample's shape without the batch",
                "e.g. input_shape=(1, 28, 28) for one 28x28 grey image",
            )  # fmt: skip
        object.__setattr__(self, "input_shape", shape)
        given = self.input_dtype
        if isinstance(given, torch.dtype):  # torch.float32 means "float32"
            object.__setattr__(self, "input_dtype", str(given).removeprefix("torch."))
        if self.input_dtype not in DTYPES:
            raise invalid("input_dtype", given, f"one of {', '.join(DTYPES)} (or the torch.dtype)")
        if self.preprocess is not None and not callable(self.preprocess):
            raise invalid("preprocess", type(self.preprocess).__name__, "a function inputs -> the model's input batch")
        if self.postprocess is not None and not callable(self.postprocess):
            raise invalid("postprocess", type(self.postprocess).__name__, "a function outputs -> one value per sample")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The input's dtype as torch names it."""
        dtype: torch.dtype = getattr(torch, self.input_dtype)
        return dtype


def shape_text(shape: Sequence[int | str]) -> str:
    """A shape as Python writes a tuple: ``(3,)``, ``(N, 3)``, ``(N,)`` for a batch of scalar samples, ``()``."""
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


@contextlib.contextmanager
def as_model_spec(spec: str) -> Iterator[None]:
    """Name ``spec`` a model spec in the TaskSpecErrors raised inside: the loader calls every spec a task spec.

    `redline serve SPEC` and `redline predict SPEC` take a model spec, whose factory returns a
    Servable (or a Task); an error about it says so, hints included.
    """
    try:
        yield
    except TaskSpecError as exc:
        said = f"task spec {spec!r}"
        if not str(exc).startswith(said):
            raise
        message = f"model spec {spec!r}{str(exc)[len(said) :]}"
        for task_word, model_word in _MODEL_WORDS.items():
            message = message.replace(task_word.format(spec=spec), model_word.format(spec=spec))
        raise TaskSpecError(message) from exc.__cause__


# The loader's hints (redline.task) as they read for a model spec.
_MODEL_WORDS = {
    "the function that returns the Task (or model), e.g. '{spec}:make_task'": (
        "the function that returns the Servable (or a Task), e.g. '{spec}:make'"
    ),
    "the function that returns the Task (or model), one of:": (
        "the function that returns the Servable (or a Task), one of:"
    ),
    "the error is in the task's own code": "the error is in the model factory's own code",
    "name a function that returns a Task": "name a function that returns a Servable (or a Task)",
}


def load_servable(spec: str, *, weights: str | Path | None = None, **options: Any) -> Servable:
    """Load the Servable a spec names, with ``weights`` (a safetensors file or a checkpoint directory) loaded into its
    model."""
    return load_servable_with(spec, lambda factory: options, weights=weights)


def load_servable_with(
    spec: str, options_for: Callable[[Callable[..., Any]], dict[str, Any]], *, weights: str | Path | None = None
) -> Servable:
    """Load the Servable a spec names, its factory called with ``options_for(factory)``: the command line's texts
    read by the factory's annotations, from the one import of its module (a second would run its top level again)."""
    # Seeded from the import on: a module that builds its model or draws its data as it is imported, or a Task given
    # a module (Task(model=nn.Linear(6, 3))), builds it alike on every start.
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(UNTRAINED_SEED)
        with as_model_spec(spec):
            factory = find_factory(spec)
            made = run_factory(spec, factory, options_for(factory))
        if isinstance(made, Task):
            if weights is None:
                log.warning(
                    "task %r: no --weights given, so its model is as the task builds it: untrained (seeded with "
                    "%d, the same on every start), unless the task loads trained weights itself (redline train "
                    "--out DIR writes DIR/model.safetensors)",
                    made.name, UNTRAINED_SEED,
                )  # fmt: skip
            made = from_task(made)
    if isinstance(made, nn.Module):
        raise TaskSpecError(
            f"model spec {spec!r}: the factory returned a bare {type(made).__name__}, whose input shape is unknown\n"
            "hint: return redline.Servable(model=..., input_shape=(...), input_dtype='float32')"
        )
    if not isinstance(made, Servable):
        raise TaskSpecError(
            f"model spec {spec!r}: the factory returned {type(made).__name__}, expected a redline.Servable or a Task"
        )
    if weights is not None:
        load_weights(made.model, Path(weights))
    return made


def from_task(task: Task) -> Servable:
    """A Task's model, with its first training sample's shape and dtype as the input: as the Task's collate_fn
    batches it, where it has one (a collate_fn that casts NumPy's float64 to float32 serves float32).

    Predict and serve do not run the collate_fn on requests: where it does more to the inputs than stack and
    cast them (scales them, say), a warning says so and names the fix, a Servable with a ``preprocess``.
    """
    item = _first_item(task)
    inputs = item[0] if task.collate_fn is None else _collated_sample(task, item)
    shape, dtype = _shape_and_dtype(task, inputs)
    return Servable(model=task.build_model(), input_shape=shape, input_dtype=dtype, name=task.name)


def _collated_sample(task: Task, item: Any) -> Any:
    """The inputs of one sample as ``task.collate_fn`` batches them, without the batch dimension: of a batch of
    ``item`` alone, or, for a collate_fn that needs more (pairing samples across the batch), of the first batch
    training reads; where neither gives one, the item's own inputs, with a warning."""
    items, alone = [item], _collate(task, [item])
    rows = None if isinstance(alone, TaskError) else _batched(alone, 1)
    if rows is None:  # one item alone makes no batch of 1: the first batch training reads
        items = _first_items(task, task.batch_size or 2)
        whole = _collate(task, items) if len(items) > 1 else None
        rows = None if whole is None or isinstance(whole, TaskError) else _batched(whole, len(items))
        if rows is None:
            if isinstance(alone, TaskError):
                raise alone
            log.warning(
                "task %r: its collate_fn made a batch of one item into inputs %s, whose first dimension is not the "
                "batch of 1, so the inputs are served as train_data holds them (%s)\nhint: have the factory return "
                "redline.Servable(model=..., input_shape=(...), input_dtype=...) to say the served shape",
                task.name, describe(alone), _described(_inputs_of(item)),
            )  # fmt: skip
            return _inputs_of(item)
    if not isinstance(rows, torch.Tensor):
        return rows  # a dict, a tuple of tensors: refused as what they are
    _warn_if_changed(task, [_inputs_of(one) for one in items], rows)
    return rows[0]


def _inputs_of(item: Any) -> Any:
    """An item's inputs: the first of an (inputs, targets) pair, else the record its collate_fn reads whole."""
    return item[0] if isinstance(item, list | tuple) and len(item) == 2 else item


def _collate(task: Task, items: list[Any]) -> Any:
    """The inputs of ``task.collate_fn``'s batch of ``items``; the TaskError to raise (not raised) where it fails."""
    assert task.collate_fn is not None
    try:
        batch = task.collate_fn(items)
    except Exception as exc:  # the user's own code
        error = TaskError(
            f"task {task.name!r}: its collate_fn, given train_data's first items to learn the served input shape, "
            f"raised {describe_error(exc)}{user_line(exc)}\nhint: the error is in the collate_fn's own code; "
            "REDLINE_TRACEBACK=1 prints the whole traceback"
        )
        error.__cause__ = exc
        return error
    try:
        collated, _ = split_batch(batch, "train_data", collate_fn=task.collate_fn)
    except TaskError as exc:
        raise TaskError(f"task {task.name!r}: {exc}") from None
    if isinstance(collated, np.ndarray) and collated.dtype.kind in "biuf":
        collated = torch.from_numpy(collated.astype(collated.dtype.newbyteorder("=")))
    return collated


def _batched(collated: Any, size: int) -> Any:
    """``collated`` where it is a batch of ``size`` samples (or not a tensor: a dict, a tuple, refused later); None
    where it is a tensor of another batch."""
    if not isinstance(collated, torch.Tensor):
        return collated
    return collated.detach().cpu() if collated.ndim and collated.shape[0] == size else None


def _warn_if_changed(task: Task, inputs: list[Any], rows: torch.Tensor) -> None:
    """Warn where the collate_fn's ``rows`` hold other than the items' ``inputs`` stacked and cast: predict and serve
    do not run it. Rows in another order than the items (a collate_fn that pairs them) are not a change."""
    unmatched = list(range(len(inputs)))
    for row in rows:
        found = next((i for i in unmatched if not _changed(inputs[i], row)), None)
        if found is None:
            break
        unmatched.remove(found)
    if not unmatched:
        return
    before, after = _described(inputs[0]), describe(rows[0])
    change = "with other values" if before == after else f"as {after}"
    log.warning(
        "task %r: its collate_fn does more to the inputs than stack and cast them (the first item's, %s, come "
        "out of it %s), and predict and serve do not run it: a request's samples reach the model as they come, "
        "so they must be as collate_fn makes them; to take them as train_data holds them, have the factory "
        "return redline.Servable(model=..., input_shape=(...), input_dtype=..., preprocess=...) whose "
        "preprocess does to a batch what collate_fn does",
        task.name, before, change,
    )  # fmt: skip


def _changed(inputs: Any, sample: torch.Tensor) -> bool:
    """Whether ``sample`` (one collated sample) holds other than ``inputs`` (the item's) cast to its dtype."""
    try:
        plain = inputs.detach().cpu() if isinstance(inputs, torch.Tensor) else torch.as_tensor(np.asarray(inputs))
    except (TypeError, ValueError, RuntimeError):  # text, say, that the collate_fn turns into numbers
        return True
    if plain.shape != sample.shape:
        return True
    return not torch.allclose(plain.to(sample.dtype), sample, rtol=0, atol=0, equal_nan=True)


def _described(inputs: Any) -> str:
    """``inputs`` described as ``describe`` does a tensor: an array by its shape and dtype too."""
    if isinstance(inputs, np.ndarray):
        return f"array{inputs.shape} {inputs.dtype}"
    return describe(inputs)


def _shape_and_dtype(task: Task, sample: Any) -> tuple[tuple[int, ...], str]:
    """The shape and served dtype of one sample's inputs: a tensor (any dtype, device or grad), an array or numbers.

    A dtype the server does not take is served as the widest of its kind: int16 token ids as int64, not floats.
    Inputs that are not one array of numbers (a dict, a tuple of tensors, text) are a TaskError: no request
    body holds them.
    """
    if isinstance(sample, torch.Tensor):
        shape, name = tuple(sample.shape), str(sample.dtype).removeprefix("torch.")
        kind = "c" if sample.is_complex() else "f" if sample.is_floating_point() else "b" if name == "bool" else "i"
    elif isinstance(sample, list | tuple) and any(isinstance(v, torch.Tensor) and v.ndim for v in sample):
        shape, name, kind = (), "object", "O"  # a model's several inputs: numpy would stack those of one shape
    else:
        try:
            array = np.asarray(sample)
        except (ValueError, TypeError):  # ragged lists
            array = np.empty(0, dtype=object)
        shape, name, kind = tuple(array.shape), str(array.dtype), array.dtype.kind
    if kind not in "biuf":
        raise TaskError(
            f"task {task.name!r}: the inputs of train_data's first item are {describe(sample)}, not one tensor or "
            "array of numbers, so a request cannot hold them\nhint: have the factory return redline.Servable("
            "model=..., input_shape=(...), input_dtype=...) around a module that takes one tensor per sample "
            "and builds the model's inputs from it, holding the task's model as a child (self.inner = model): "
            "--weights of a run of this task load into that child"
        )
    return shape, name if name in DTYPES else ("int64" if kind in "iu" else "float32")


def _first_items(task: Task, count: int) -> list[Any]:
    """Up to ``count`` first items of ``task.train_data`` (a stream's included); fewer where it holds fewer, or
    where reading them fails (the first item, read before, is what the served shape is taken from then)."""
    data = task.train_data
    try:
        if isinstance(data, IterableDataset):
            return list(itertools.islice(iter(data), count))
        return [data[i] for i in range(min(count, len(data)))]  # type: ignore[arg-type]
    except Exception:  # the dataset's own code; the first item was read without error
        return []


def _first_item(task: Task) -> Any:
    """The first item of ``task.train_data``, a stream's included, an (inputs, targets) pair; a TaskError where
    there is none."""
    data = task.train_data
    try:
        item = next(iter(data), None) if isinstance(data, IterableDataset) else data[0]
    except Exception as exc:  # the dataset's own code: a missing file, say
        raise TaskError(
            f"task {task.name!r}: reading the first item of train_data, whose inputs give the served input shape, "
            f"raised {describe_error(exc)}{user_line(exc)}\nhint: the error is in the dataset's own code; "
            "REDLINE_TRACEBACK=1 prints the whole traceback"
        ) from exc
    if item is None or (task.collate_fn is None and not (isinstance(item, list | tuple) and len(item) == 2)):
        found = "nothing (the stream is empty)" if item is None else describe(item)
        fix = "check what the stream reads" if item is None else PAIR_HINT
        raise TaskError(
            f"task {task.name!r}: the first item of train_data is {found}, not a pair (inputs, targets), so the "
            f"input shape to serve is unknown\nhint: {fix}, or have the factory return "
            "redline.Servable(model=..., input_shape=(...), input_dtype='float32')"
        )
    return item


def as_servable(model: Servable | nn.Module, input_shape: Sequence[int] | None, input_dtype: str | None) -> Servable:
    """Return ``model`` as a Servable: itself, or a bare module with the input's shape and dtype given."""
    if isinstance(model, Servable):
        if input_shape is not None or input_dtype is not None:
            name, given = ("input_shape", input_shape) if input_shape is not None else ("input_dtype", input_dtype)
            names = f"input_shape={model.input_shape}, input_dtype={model.input_dtype!r}"
            fix = f"the Servable names them ({names}): leave {name} out, or build the Servable with the one meant"
            raise invalid(name, given, "nothing when a Servable is passed", fix)
        return model
    if not isinstance(model, nn.Module):
        raise invalid(
            "model", type(model).__name__, "an nn.Module (with input_shape=...) or a redline.Servable",
            "wrap a plain function in an nn.Module",
        )  # fmt: skip
    if input_shape is None:
        raise ConfigError(
            f"InferenceEngine({type(model).__name__}) needs input_shape: one sample's shape, without the batch\n"
            "hint: InferenceEngine(model, input_shape=(3, 32, 32)), or pass a redline.Servable"
        )
    shape = tuple(input_shape) if isinstance(input_shape, Sequence) else input_shape  # a lone 4: Servable says why
    return Servable(model=model, input_shape=shape, input_dtype=input_dtype or "float32", name=type(model).__name__)
