"""What the Trainer (and bench) expects of a Task's data, loss and metric, checked where each first shows.

Every check reads only what is already on the host (a batch's structure, a tensor's shape and
flags): none waits for the device. A mistake is a ``TaskError`` that names the object, what was
expected and what came; an exception raised inside the user's own code is a ``TrainingError``
that shows the user's line, so a genuine bug there is not passed off as a data mistake.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import default_collate

from redline.errors import (
    RedlineError,
    TaskError,
    TrainingError,
    first_line,
    raised_in_redline,
    user_line,
    worker_failure,
    wrapping_errors,
)
from redline.parallel.collectives import is_collective_failure
from redline.runtime.cuda_errors import is_sticky_cuda_error
from redline.runtime.loss import check_loss, task_loss
from redline.runtime.oom import is_oom
from redline.task.definition import is_array

__all__ = [
    "blames_user_code",
    "check_loss",
    "count_samples",
    "count_tokens",
    "describe",
    "metric_value",
    "split_batch",
    "task_loss",
    "user_code",
    "user_line",
    "users_failure",
]

PAIR_HINT = "return (inputs, targets) from the dataset's __getitem__ (a TensorDataset(x, y) does)"
COLLATE_PAIR_HINT = (
    "the collate_fn builds each batch: return (inputs, targets) from it (the inputs may be a tuple or dict the model "
    "takes)"
)


def split_batch(batch: Any, data: str, *, collate_fn: Callable[[list[Any]], Any] | None = None) -> tuple[Any, Any]:
    """Return a collated batch's (inputs, targets); ``data`` names the dataset ("train_data").

    ``collate_fn`` is the loader's (torch's ``default_collate`` where it has none of its own): the hint for a batch
    that is not a pair names the code that built it. Left out, it names both, the dataset and a collate_fn.
    """
    if isinstance(batch, list | tuple) and len(batch) == 2:
        return batch[0], batch[1]
    found = f"a {len(batch)}-tuple {describe(batch)}" if isinstance(batch, list | tuple) else describe(batch)
    if collate_fn is None:
        hint = f"{PAIR_HINT}, or from the collate_fn where one builds the batches"
    else:
        hint = COLLATE_PAIR_HINT if users_collate(collate_fn) else PAIR_HINT
    raise TaskError(f"each item of {data} must be a pair (inputs, targets); the loader gave {found}\nhint: {hint}")


def users_collate(collate_fn: Callable[[list[Any]], Any]) -> bool:
    """Whether ``collate_fn`` is the user's own (a Task's, a DataLoader's), not torch's default nor redline's."""
    return collate_fn is not default_collate and not getattr(collate_fn, "__module__", "").startswith("redline.runtime")


IGNORE_INDEX = -100  # torch's cross_entropy and nll_loss default ignore_index: the target a padded position is given


def count_tokens(targets: Any) -> torch.Tensor | None:
    """The tokens of a batch whose ``targets`` are token ids, else None (tokens/s then does not apply).

    Token ids are an integer tensor of shape (batch, sequence), as a language model's or a seq2seq decoder's; not class
    labels (batch,), nor a segmentation's (batch, height, width) pixels. Its tokens are the positions whose target is
    not ``IGNORE_INDEX`` (padding), counted as a 0-d tensor on the targets' device, so that counting asks no sync.
    """
    if not isinstance(targets, torch.Tensor) or targets.dim() != 2:
        return None
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        return None
    return (targets != IGNORE_INDEX).sum()


def metric_value(value: Any) -> float:
    """Return ``task.metric``'s result as a float: a number or a one-element tensor."""
    if isinstance(value, bool) or not isinstance(value, int | float | torch.Tensor):
        raise TaskError(
            f"task.metric(outputs, targets) returned {describe(value)}; expected a number (higher is better)\n"
            "hint: return a float or a one-element tensor, e.g. (outputs.argmax(1) == targets).float().mean()"
        )
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise TaskError(
            f"task.metric(outputs, targets) returned a tensor of shape {tuple(value.shape)}; expected one number\n"
            "hint: reduce it over the batch, e.g. .mean()"
        )
    return float(value)


def count_samples(inputs: Any) -> int:
    """The batch size of ``inputs``: the first axis of its first tensor or array (in a tuple, list or dict); where it
    holds none, the raw samples' count: a list's length (of strings, token lists: a text model's own batch), or the
    length of a dict's first list. A string is one sample, never its characters."""
    size = _first_axis(inputs)
    if size is not None:
        return size
    if isinstance(inputs, Mapping):
        return next((len(value) for value in inputs.values() if isinstance(value, list | tuple)), 1)
    return len(inputs) if isinstance(inputs, list | tuple) else 1


def _first_axis(inputs: Any) -> int | None:
    """The first axis of the first tensor or array in ``inputs`` (a 0-d one counts 1), or None where it holds none."""
    if is_array(inputs):
        return int(inputs.shape[0]) if len(inputs.shape) else 1
    values = inputs.values() if isinstance(inputs, Mapping) else inputs if isinstance(inputs, list | tuple) else ()
    for value in values:
        size = _first_axis(value)
        if size:
            return size
    return None


def blames_user_code(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's code's to answer for (model, loss, metric, a Servable's function), not redline's.

    A redline error is redline's word, and an exception redline's own code raised is its bug: that one
    must reach the user with its traceback, not as a message blaming the model. The device failing
    (out of memory, a sticky CUDA error: seen wherever redline synchronises) is the workload's.
    """
    if isinstance(exc, RedlineError):
        return False
    return is_oom(exc) or is_sticky_cuda_error(exc) or not raised_in_redline(exc)


@wrapping_errors
def users_failure(what: str, hint: str) -> Iterator[None]:
    """Say an exception from the user's code inside (or torch's under it) as a TrainingError showing their line:
    "{what} raised Type: first line". redline's own errors and bugs, and an out-of-memory, pass as they are."""
    try:
        yield
    except RedlineError:
        raise
    except Exception as exc:
        if is_oom(exc) or not blames_user_code(exc):
            raise
        said, line, where = first_line(exc), user_line(exc), ""
        if (worker := worker_failure(exc)) is not None:  # the worker's own message and line, not torch's wrapping
            (said, line), where = worker, " in a loader worker"
        raise TrainingError(f"{what} raised {type(exc).__name__}{where}: {said}{line}\nhint: {hint}") from exc


class Forward:
    """What the model returned inside ``user_code``, kept there by the caller (``forward.outputs = model(x)``)
    so that an error in the loss that follows can say what the loss was given."""

    def __init__(self) -> None:
        self.returned = False
        self._outputs: Any = None

    @property
    def outputs(self) -> Any:
        return self._outputs

    @outputs.setter
    def outputs(self, value: Any) -> None:
        self._outputs, self.returned = value, True


ONE_SAMPLE_HINT = (
    "a batch norm layer normalises each channel over the batch, so it cannot train on one sample: use batches of 2 or "
    "more per process"
)


def one_sample_refusal(exc: BaseException) -> BaseException | None:
    """A batch norm's refusal of a batch of one sample in training ("Expected more than 1 value per channel when
    training"): ``exc``, or the error of torch's that redline wrapped in it; None where it is none."""
    cause = exc.__cause__ if isinstance(exc, RedlineError) else exc
    return cause if isinstance(cause, ValueError) and "more than 1 value per channel" in str(cause) else None


@wrapping_errors
def user_code(
    where: str, inputs: Any, targets: Any, *, metric: bool = False, data: str = "the dataset"
) -> Iterator[Forward]:
    """Turn an exception from the model, loss or metric into a TrainingError that shows the user's line.

    ``metric`` says the code inside is ``task.metric``, and ``inputs`` are then the model's outputs; ``data`` names the
    dataset the batch came from ("val_data"), where the hint should.
    The caller may keep the model's outputs on the ``Forward`` it yields: when the loss then fails on a
    model that returned a tuple or a dict, the error says so.

    A redline error passes unchanged, and so do a failed collective (a peer's death, told apart
    by the caller), an out-of-memory (recovered from by micro-batches, or reported as such) and an
    exception redline's own code raised (``blames_user_code``).
    """
    forward = Forward()
    try:
        yield forward
    except RedlineError:
        raise
    except Exception as exc:
        if is_collective_failure(exc) or is_oom(exc) or not blames_user_code(exc):
            raise
        if UNUSED_BEFORE in str(exc):  # DDP's reducer, in a forward: not this batch's mistake but the step before's
            raise TrainingError(unused_before(where, str(exc))) from exc
        first = str(exc).splitlines()[0] if str(exc) else ""
        line = user_line(exc)
        culprit, given = "the model or loss", f"inputs {describe(inputs)}, targets {describe(targets)}"
        if metric:
            culprit, given = "task.metric", f"outputs {describe(inputs)}, targets {describe(targets)}"
            hint = "task.metric(outputs, targets) is given the model's outputs and the batch's targets, as shown"
            found = "; the line above is where it failed"
        elif forward.returned and not isinstance(forward.outputs, torch.Tensor):  # the loss failed on them
            outputs, kind = forward.outputs, type(forward.outputs).__name__
            part = f"outputs[{next(iter(outputs))!r}]" if isinstance(outputs, Mapping) and outputs else "outputs[0]"
            culprit, given = "loss_fn(outputs, targets)", f"{given}\n  outputs: {describe(outputs)}"
            hint = (
                f"the model returned a {kind}, and loss_fn is given it as it is: take the tensor the loss needs "
                f"inside loss_fn ({part}, say), or return one tensor from forward"
            )
            found = "; the line above is where the loss failed"
        elif one_sample_refusal(exc):
            culprit, hint, found = "the model", ONE_SAMPLE_HINT, "; the line above is the layer's call"
        else:
            hint, found = _failure_hint(exc, first, inputs, data)
        if line:
            hint += f"{found} (REDLINE_TRACEBACK=1 prints the whole traceback; in Python it is the error's __cause__)"
        raise TrainingError(
            f"{where}: {culprit} raised {type(exc).__name__}: {first}\n  batch: {given}{line}\nhint: {hint}"
        ) from exc


def _failure_hint(exc: Exception, first: str, inputs: Any, data: str) -> tuple[str, str]:
    """The hint for a model or loss that failed on a batch of ``data`` (``first``: the error's first line), and what
    the line shown below it is."""
    if "view size is not compatible with input tensor's size and stride" in first:
        hint = (
            ".view needs a contiguous tensor, and with channels_last on a convolution's output is NHWC: use "
            ".reshape(...) there, or channels_last auto (which keeps such a model NCHW) or off"
        )
        return hint, "; the line above is the .view"
    if one_argument := one_argument_hint(exc, first, inputs):
        return one_argument
    if HALF_NAMED.search(first) or (ONEDNN_REFUSED in first and _autocast_on()):
        hint = (
            "an op of the model has no kernel for the reduced precision it ran in on this device (fp16 on a CPU, "
            "often): run it with --precision fp32 (precision='fp32'), or bf16-mixed where fp16-mixed failed; in an "
            "fp32 run, cast float16 or bfloat16 inputs .float() in the dataset"
        )
        return hint, "; the line above is the op's call"
    if weights := _model_dtype(first, inputs):
        hint = (
            f"the inputs are float32 and the model's weights {weights}: build the model in float32 (leave out "
            ".double() or .half(): --precision runs mixed precision over float32 weights), or cast the inputs to "
            "the model's dtype in the dataset's __getitem__ (or collate_fn)"
        )
        return hint, "; if they fit, the line above is where your code failed"
    if DTYPE_TROUBLE.search(first):
        hint = (
            "a dtype does not fit (the batch above shows each): cast in the dataset's __getitem__ (or collate_fn), "
            "inputs .float() to match the model's float32 weights (NumPy's arrays are float64), class targets "
            ".long() for cross_entropy, targets .float() for mse_loss or binary_cross_entropy"
        )
        return hint, "; if they fit, the line above is where your code failed"
    shaped = "train_data's, on which the steps ran" if data == "val_data" else "the model expects"
    return f"check that {data}'s items are (inputs, targets) shaped as {shaped}", (
        "; if they are, the line above is where your code failed"
    )


# A layer's refusal of float32 inputs for weights of another dtype, in torch's words (a Linear's matmul, a
# convolution's, an RNN's), and what each names the weights' dtype
WEIGHTS_CAST = re.compile(
    r"mat1 and mat2 must have the same dtype, but got Float and (\w+)"
    r"|Input type \(float\) and (?:bias|weight) type \(([\w:]+)\) should be the same"
    r"|input dtype \(torch\.float32\) does not match weight dtype \(torch\.(\w+)\)"
    r"|Input type \(torch\.(?:cuda\.)?FloatTensor\) and weight type \(torch\.(?:cuda\.)?(\w+)Tensor\)"
    r"|expected scalar type Float but found (\w+)"  # a convolution without bias, on a CPU
)
CAST_MODEL = {"float64": "are float64 (a .double() model)", "float16": "are float16 (a .half() model)",
              "bfloat16": "are bfloat16 (a .bfloat16() model)"}  # fmt: skip
TORCH_NAMES = {
    "Double": "float64",
    "double": "float64",
    "Half": "float16",
    "c10::Half": "float16",
    "BFloat16": "bfloat16",
    "c10::BFloat16": "bfloat16",
}  # the old tensor types' names too: torch.DoubleTensor gives "Double"


def _model_dtype(first: str, inputs: Any) -> str:
    """What the weights are where a layer refused float32 inputs (``first``, torch's message) for weights of another
    floating-point dtype (a model cast with .double() fed the dataset's float32); "" otherwise."""
    found = WEIGHTS_CAST.search(first)
    if found is None or not (isinstance(inputs, torch.Tensor) and inputs.dtype == torch.float32):
        return ""
    named = next(group for group in found.groups() if group)
    return CAST_MODEL.get(TORCH_NAMES.get(named, named), "")


# DDP's reducer at the forward after a backward that left a parameter without a gradient; its next lines name them
# by index ("Parameter indices which did not receive grad for rank 1: 6 7"), or by name under
# TORCH_DISTRIBUTED_DEBUG=DETAIL ("Parameters which did not receive grad for rank 1: extra.bias, extra.weight")
UNUSED_BEFORE = "Expected to have finished reduction in the prior iteration"
NO_GRAD = re.compile(r"Parameter(s| indices) which did not receive grad for rank \d+: ([^\n]*)")


def unused_before(where: str, text: str) -> str:
    """The message for DDP's refusal (``text``) of a forward after a step that left parameters without a gradient:
    the first step is checked for them (``DDP._first_reduction_checked``), a later one only by DDP."""
    which = ""
    if named := NO_GRAD.search(text):  # without the rank: ranks that say the same are printed once by the launcher
        kind, listed = named.groups()
        which = (
            f" ({listed})" if kind == "s" else f" (DDP numbers them {listed}, counting from 0 those that require one)"
        )
    return (
        f"{where}: under DDP every parameter that requires a gradient must get one from the loss, and the step before "
        f"left some without one{which}; DDP's reducer waits for their gradients, so this step cannot start\nhint: a "
        "model that uses other parameters in other steps (a head on some steps, a branch chosen by the data) trains "
        "under DDP with --find-unused-parameters (find_unused_parameters=True), at the cost of a walk of the autograd "
        "graph each step; freeze what the loss never uses (param.requires_grad_(False))"
    )


FORWARD_WANTS_MORE = re.compile(r"forward\(\) missing \d+ required positional argument")  # forward(self, a, b)


def one_argument_hint(exc: Exception, first: str, inputs: Any) -> tuple[str, str] | None:
    """The hint, and where the user's line is, for a forward that wants the batch's ``inputs`` as several arguments:
    a tuple's (forward() missing an argument), or a dict's, taken for a tensor ("ones_like(): ... must be Tensor, not
    dict", "'dict' object has no attribute 'shape'"); None for any other ``exc`` (its first line ``first``)."""
    wants_more = isinstance(exc, TypeError) and bool(FORWARD_WANTS_MORE.search(first))
    took_dict = isinstance(exc, TypeError | AttributeError) and "dict" in first
    if isinstance(inputs, tuple | list) and wants_more:
        return (
            "the model is called with the batch's inputs as one argument, model(inputs): a model of several "
            "inputs takes them as one tuple (def forward(self, inputs): a, b = inputs), its items ((a, b), targets)"
        ), "; the line above is the model's call"
    if isinstance(inputs, Mapping) and (wants_more or took_dict):
        return (
            "the model is called with the batch's inputs as one argument, model(inputs), here the whole dict: give "
            "the model a forward that takes the dict, a wrapper's, say (def forward(self, batch): return "
            "self.model(**batch))"
        ), "; the line above is where the dict was read"
    return None


# torch's words for operands of the wrong dtype: "mat1 and mat2 must have the same dtype", "expected target dtype to be
# Long", "result type Float can't be cast to the desired output type Long", "expected scalar type Long but found Int"
DTYPE_TROUBLE = re.compile(r"dtype|scalar type|can't be cast to the desired|not implemented for '")
# an op without a kernel for half precision, in torch's words; oneDNN's (a CPU's LSTM in fp16) say so under autocast
HALF_NAMED = re.compile(r"not implemented for '(Half|BFloat16)'")
ONEDNN_REFUSED = "could not create a primitive descriptor"


def _autocast_on() -> bool:
    """Whether the failed call ran under autocast (the step's and the evaluation's forward are inside it)."""
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def describe(value: Any) -> str:
    """A short description of a batch or a value: tensors by shape and dtype, containers by their parts."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, list | tuple):
        return "(" + ", ".join(describe(v) for v in value[:4]) + (", ..." if len(value) > 4 else "") + ")"
    if isinstance(value, Mapping):
        keys = list(value)[:4]
        return "{" + ", ".join(f"{k!r}: {describe(value[k])}" for k in keys) + (", ..." if len(value) > 4 else "") + "}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
