"""Request bodies read into a batch the model can take, or refused with a message naming the problem.

Two forms: JSON ``{"inputs": sample}`` or ``{"inputs": [sample, ...]}``, and a .npy array
(``application/octet-stream``) of one sample or a stack of them. Either way the batch reaching the
model has the Servable's sample shape and dtype, finite values and at most ``max_batch_size``
samples: nothing malformed reaches the model. An unreadable body is a 400; a readable one with the
wrong shape, dtype or number of samples a 422.
"""

from __future__ import annotations

import io
import json
import math
import re
import tokenize
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from redline.errors import ServableError, invalid
from redline.serve.refused import Refused
from redline.serve.servable import Servable, shape_text

if TYPE_CHECKING:
    import orjson

NPY_MAGIC = (
    b"\x93NUMPY"  # how a .npy file starts: https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html
)
_KINDS = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers"}
# What an array no input takes holds, in words (numpy's dtype kinds): `redline predict` reads any .npy file
_OTHER_KINDS = {"c": "complex numbers", "U": "text", "S": "bytes", "O": "Python objects", "M": "dates",
                "m": "time spans", "V": "records of fields"}  # fmt: skip
FIRST_IN_SAMPLE = ", the first in sample "  # how a refusal names the first sample holding a bad value
JSON_NUMBER = re.compile(rb"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")  # RFC 8259, section 6


@dataclass(frozen=True)
class InputSpec:
    """What a request's inputs must be: one sample's shape and dtype, and the most samples in one request."""

    shape: tuple[int, ...]
    dtype: str  # one of redline.serve.servable.DTYPES
    max_batch_size: int

    def refuse(self, status: int, problem: str) -> Refused:
        """A refusal naming ``problem`` and what was expected."""
        expected = {"expected_shape": list(self.shape), "expected_dtype": self.dtype,
                    "max_batch_size": self.max_batch_size}  # fmt: skip
        reason = "bad_request" if status == 400 else "invalid_input"
        return Refused(status, reason, f"{problem}; expected {self.describe()}", fields=expected)

    def describe(self) -> str:
        """The expected inputs in words."""
        return (
            f"{self.dtype} {_KINDS[self.kind()]}, one sample of shape {shape_text(self.shape)} "
            f"or up to {self.max_batch_size} of them, shape {shape_text(('N', *self.shape))}"
        )

    def kind(self) -> str:
        """The numpy kind of the dtype: b, i, u or f."""
        return "f" if self.dtype == "bfloat16" else np.dtype(self.dtype).kind


def read_json(body: bytes, spec: InputSpec) -> torch.Tensor:
    """Return the batch a JSON body holds under ``inputs``."""
    import orjson  # the serve extra's, imported by the server alone: predict and the engine need none of it

    if body.startswith(NPY_MAGIC):  # numpy.save's bytes sent as JSON: orjson would speak of UTF-8 surrogates
        raise spec.refuse(
            400, "the body is a .npy array, sent as JSON (Content-Type application/json); send it with "
            "Content-Type: application/octet-stream",
        )  # fmt: skip
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _unreadable_json(exc, body, spec) from None
    if not isinstance(document, dict):
        raise spec.refuse(422, 'the body must be a JSON object {"inputs": [...]}')
    if "inputs" not in document:  # a typo ("input"), or another server's key ("instances")
        keys = ", ".join(orjson.dumps(key).decode() for key in list(document)[:5]) or "none"
        raise spec.refuse(422, f'the JSON object has no "inputs" key (its keys: {keys}); send {{"inputs": [...]}}')
    inputs = document["inputs"]
    if isinstance(inputs, list) and len(inputs) > spec.max_batch_size and _depth(inputs) == len(spec.shape) + 1:
        raise _too_many(len(inputs), spec)  # before numpy reads a batch that is refused anyway, number by number
    try:
        array = np.asarray(inputs)
    except (ValueError, OverflowError):  # ragged lists (numpy >= 1.24 refuses them), or nested past numpy's limit
        where, depth = _ragged(inputs, "inputs"), _depth(inputs)
        if where is None and depth > len(spec.shape) + 1:  # nested past numpy's limit of dimensions
            nested = f"a batch of samples of shape {shape_text(spec.shape)} is nested {len(spec.shape) + 1} deep"
            raise spec.refuse(422, f"inputs are lists nested {depth} deep; {nested}") from None
        raise spec.refuse(422, "inputs are nested lists of unequal lengths" + (f": {where}" if where else "")) from None
    if array.dtype.kind not in "biuf":
        raise spec.refuse(422, "inputs hold values that are not numbers (text, null, objects or too large integers)")
    # numpy reads true/false among numbers as 1/0: look for them only when the body has such a word
    if spec.kind() != "b" and array.dtype.kind != "b" and (b"true" in body or b"false" in body) and _has_bool(inputs):
        raise spec.refuse(422, "inputs hold true/false where numbers are expected")
    return check_array(array, spec)


def _too_many(samples: int, spec: InputSpec) -> Refused:
    return spec.refuse(
        422, f"inputs hold {samples} samples, more than max_batch_size={spec.max_batch_size} in one request"
    )


def _unreadable_json(exc: orjson.JSONDecodeError, body: bytes, spec: InputSpec) -> Refused:
    """400 for a body that is not JSON; 422 where it fails on a value no sample can hold, named where it is.

    Python's json.dumps writes NaN, Infinity and -Infinity (unless allow_nan=False), which JSON has
    no number for; a number beyond float64's range (1e400) is infinite too.
    """
    start = exc.pos - 1 if body[exc.pos - 1 : exc.pos] == b"-" else exc.pos  # -Infinity fails at its I
    where = f"line {exc.lineno} column {exc.colno - (exc.pos - start)}"
    word = next((w for w in (b"NaN", b"Infinity") if body.startswith(w, exc.pos)), None)
    if word is not None:
        shown = body[start : exc.pos + len(word)].decode()
        return spec.refuse(
            422, f"the body holds {shown} at {where}, which JSON has no number for (Python's json.dumps writes it "
            "unless allow_nan=False); send finite numbers",
        )  # fmt: skip
    number = JSON_NUMBER.match(body, exc.pos)
    if number is not None and math.isinf(float(number.group())):
        return spec.refuse(422, f"the body holds {number.group().decode()} at {where}, beyond float64's range")
    return spec.refuse(400, f"the body is not valid JSON ({exc})")


def _ragged(value: Any, path: str) -> str | None:
    """Where nested lists first differ: ``inputs[1][0] has 2 items where inputs[0][0] has 3``; None if nowhere.

    Every list is held against the one at its depth along the first items (``inputs[0][0]``), so lists that
    differ across samples are found as well as those within one.
    """
    chain = [value]  # inputs, inputs[0], inputs[0][0], ...
    while isinstance(chain[-1], list) and chain[-1] and len(chain) <= 32:  # numpy takes at most 32 dimensions
        chain.append(chain[-1][0])
    return _unlike(value, path, chain, path, 0)


def _unlike(value: Any, path: str, chain: list[Any], root: str, depth: int) -> str | None:
    if depth >= len(chain):
        return None
    model = chain[depth]
    if _length(value) != _length(model):
        return f"{path} {_holds(value)} where {root}{'[0]' * depth} {_holds(model)}"
    if not isinstance(value, list):
        return None
    return next(
        (found for i, item in enumerate(value) if (found := _unlike(item, f"{path}[{i}]", chain, root, depth + 1))),
        None,
    )


def _length(value: Any) -> int | None:
    return len(value) if isinstance(value, list) else None


def _depth(value: Any) -> int:
    """How deep the first items of nested lists go: ``[[1, 2]]`` is 2 deep."""
    depth = 0
    while isinstance(value, list) and value:
        value, depth = value[0], depth + 1
    return depth


def _holds(item: Any) -> str:
    """What a JSON value is, said after its path."""
    if isinstance(item, list):
        return f"has {len(item)} item{'s' * (len(item) != 1)}"
    if isinstance(item, bool) or item is None:
        return f"is {json.dumps(item)}"
    return {int: "is a number", float: "is a number", str: "is text"}.get(type(item), "is an object")


def _has_bool(value: Any) -> bool:
    if isinstance(value, list):
        return any(_has_bool(item) for item in value)
    return isinstance(value, bool)


def read_npy(body: bytes, spec: InputSpec) -> torch.Tensor:
    """Return the batch a .npy body holds, reading the header first so that a lying one allocates nothing."""
    if body.lstrip()[:1] in (b"{", b"["):  # numpy would speak of its magic string
        raise spec.refuse(
            400, "the body is JSON, sent as a .npy array (Content-Type application/octet-stream); send it with "
            "Content-Type: application/json",
        )  # fmt: skip
    stream = io.BytesIO(body)
    try:
        version = np.lib.format.read_magic(stream)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = header(stream)
    # numpy tokenizes the header text: one cut off mid-bracket raises tokenize's own error, no ValueError
    except (ValueError, OSError, EOFError, SyntaxError, TypeError, tokenize.TokenError) as exc:
        raise spec.refuse(400, f"the body is not a .npy array ({exc})") from None
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise spec.refuse(400, f"the .npy array's header gives the shape {shape}, with a negative dimension")
    if dtype.hasobject or dtype.kind not in "biuf":
        raise spec.refuse(422, f"the .npy array holds {dtype} values, not numbers")
    data = body[stream.tell() :]
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise spec.refuse(400, f"the .npy array's header says {shape} {dtype}, but {len(data)} bytes of data follow")
    array = np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran_order else "C")
    return check_array(array, spec)


def check_array(array: np.ndarray[Any, Any], spec: InputSpec) -> torch.Tensor:
    """Return ``array`` as a batch of ``spec``'s shape and dtype, or refuse it (422) naming the problem."""
    if array.shape[:1] == (0,):  # [] or an empty stack: no sample of any shape
        raise spec.refuse(422, "inputs hold no sample")
    if array.shape == spec.shape:
        array = array[None]
    elif array.ndim != len(spec.shape) + 1 or array.shape[1:] != spec.shape:
        raise spec.refuse(422, f"inputs have shape {shape_text(array.shape)}")
    if array.shape[0] > spec.max_batch_size:
        raise _too_many(array.shape[0], spec)
    kind = spec.kind()
    if kind in "iu" and array.dtype.kind == "f":
        array = _whole_numbers(array, spec)
    allowed = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}[kind]
    if array.dtype.kind not in allowed:
        kind_said = _KINDS.get(array.dtype.kind) or _OTHER_KINDS.get(array.dtype.kind, "not numbers")
        raise spec.refuse(422, f"inputs are {kind_said} ({array.dtype})")
    if kind in "iu":
        info = np.iinfo(spec.dtype)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise _bad_values(spec, (array < info.min) | (array > info.max), _outside_range(spec.dtype))
    if kind == "f":  # the bound /openapi.json states; NaN fails the comparison too
        largest = float(torch.finfo(getattr(torch, spec.dtype)).max)
        finite = np.abs(array.astype(np.float64)) <= largest
        if not finite.all():
            problem = f"inputs hold values that are not finite in {spec.dtype} (NaN, infinity or beyond ±{largest:.6g})"
            raise _bad_values(spec, ~finite, problem)
    target = np.float32 if spec.dtype == "bfloat16" else np.dtype(spec.dtype)
    batch = torch.from_numpy(np.ascontiguousarray(array.astype(target)))
    return batch.to(getattr(torch, spec.dtype))


def _whole_numbers(array: np.ndarray[Any, Any], spec: InputSpec) -> np.ndarray[Any, Any]:
    """Floats for an integer input as int64, or refused naming the first sample holding a fraction or too large a value.

    Whole numbers written as 2.0 are integers (as JSON Schema reads them); a JSON integer of 2**64 or
    more comes as a float too (orjson reads at most 64 bits).
    """
    whole = np.isfinite(array) & (array == np.round(array))
    if not whole.all():  # the sample is named: one row of a large file, say, not "every sample"
        problem = f"inputs hold values that are not whole numbers (a fraction, NaN or infinity), where {spec.dtype}"
        raise _bad_values(spec, ~whole, problem + " takes integers")
    fits = np.abs(array.astype(np.float64)) < 2.0**63
    if not fits.all():
        raise _bad_values(spec, ~fits, _outside_range(spec.dtype))
    return array.astype(np.int64)


def _bad_values(spec: InputSpec, bad: np.ndarray[Any, Any], problem: str) -> Refused:
    """A 422 for the values ``bad`` marks in a batch, naming (in a batch of several) the first sample holding one.

    The answer's ``first_bad_sample`` field gives that sample's index.
    """
    first = int(np.argmax(bad.reshape(len(bad), -1).any(axis=1)))
    refused = spec.refuse(422, problem + (f"{FIRST_IN_SAMPLE}{first}" if len(bad) > 1 else ""))
    refused.fields["first_bad_sample"] = first
    return refused


def _outside_range(dtype: str) -> str:
    info = np.iinfo(dtype)
    return f"inputs hold integers outside {dtype}'s range [{info.min}, {info.max}]"


def refuse_changed_by_cast(inputs: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse a batch holding a value the cast to ``dtype`` would change without a word (300 becomes 44 in uint8,
    NaN a large negative integer, 1e6 infinity in float16), naming the first row that holds one."""
    if inputs.dtype == dtype or inputs.numel() == 0:
        return
    # widened: a bound compared with a narrow tensor is cast to its dtype (int8 against int64's bounds overflows);
    # uint64 as double, as .long() wraps it negative from 2**63 on (2**64 - 1 became -1)
    unsigned_64 = inputs.dtype == torch.uint64
    values = inputs.double() if inputs.is_floating_point() or unsigned_64 else inputs.long()
    if dtype == torch.bool:
        bad, allowed = (values != 0) & (values != 1), "0 or 1 (False or True)"
    elif dtype.is_floating_point:
        largest = torch.finfo(dtype).max
        bad, allowed = values.isfinite() & (values.abs() > largest), f"values within {dtype}'s range ±{largest:.6g}"
    else:
        info = torch.iinfo(dtype)
        bad = (values < info.min) | (values > info.max)
        if unsigned_64:  # 2**63 as double equals int64's largest (2**63 - 1) as double: its top bit tells it
            bad |= inputs.view(torch.int64) < 0
        if inputs.is_floating_point():
            bad |= ~values.isfinite() | (values != values.round())
        allowed = f"whole numbers within {dtype}'s range [{info.min}, {info.max}]"
    if not bool(bad.any()):
        return
    row = int(bad.reshape(len(bad), -1).any(dim=1).int().argmax())
    value = inputs[row][bad[row]][0].item()
    raise invalid(
        "batch", f"row {row} holding {value!r}", str(allowed).replace("torch.", ""),
        f"the cast to the input dtype {str(dtype).removeprefix('torch.')} would change it without a word; check the "
        "inputs, or give the model a wider input_dtype",
    )  # fmt: skip


def model_inputs(servable: Servable, inputs: torch.Tensor) -> torch.Tensor:
    """The model's batch for ``inputs``: the Servable's ``preprocess`` applied, its row count checked."""
    if servable.preprocess is None:
        return inputs
    made = servable.preprocess(inputs)
    if not isinstance(made, torch.Tensor) or made.ndim == 0 or made.shape[0] != inputs.shape[0]:
        got = f"shape {tuple(made.shape)}" if isinstance(made, torch.Tensor) else type(made).__name__
        rows = inputs.shape[0]
        raise ServableError(
            f"preprocess returned {got} for {rows} samples; expected a tensor of as many rows{_preprocess_hint(made)}"
        )
    return made


def _preprocess_hint(made: Any) -> str:
    """The fix for a preprocess that returned no tensor ("" where it returned one, of other rows): the engine
    passes the model one tensor per request batch; a model taking a dict of tensors is served through a wrapper."""
    if isinstance(made, torch.Tensor):
        return ""
    hint = "\nhint: the engine passes the model one tensor per request batch, so preprocess returns one tensor"
    if not isinstance(made, Mapping):
        return hint
    return (
        f"{hint}; to serve a model that takes a dict of tensors, give the Servable a wrapper module that holds it "
        "as a child (self.inner = model) and whose forward builds the dict from the one tensor and returns the "
        "logits (return self.inner({'input_ids': x, 'attention_mask': (x != 0).long()})['logits']); --weights "
        "of the plain model (redline train --out's) load into that child"
    )


def as_batch(batch: Any, servable: Servable) -> torch.Tensor:
    """``batch`` (a tensor, an array or nested lists: ``engine.predict``'s) as a tensor of real numbers with
    ``servable``'s sample shape, or a ConfigError naming what it is."""
    shape = servable.input_shape
    expected = shape_text(("N", *shape))
    real = f"real numbers, shape {expected}, cast to {servable.input_dtype}"
    try:
        inputs = _tensor_of(batch)
    except (TypeError, ValueError, RuntimeError) as exc:  # text, objects, ragged lists
        what = f"array of {batch.dtype}" if isinstance(batch, np.ndarray) else type(batch).__name__
        hint = f"pass a tensor, a numpy array of numbers, or nested lists of equal lengths ({exc})"
        raise invalid("batch", what, real, hint) from None
    if inputs.is_complex():  # a cast would drop the imaginary part without a word
        raise invalid("batch", str(inputs.dtype).removeprefix("torch."), real, "pass batch.real if that is meant")
    if inputs.ndim != len(shape) + 1 or tuple(inputs.shape[1:]) != shape:
        one = tuple(inputs.shape) == shape
        hint = f"one sample? add the batch dimension: batch[None] has shape {shape_text((1, *shape))}" if one else ""
        raise invalid("batch", f"shape {tuple(inputs.shape)}", expected, hint)
    refuse_changed_by_cast(inputs, servable.torch_dtype)
    return inputs


def _tensor_of(batch: Any) -> torch.Tensor:
    """``batch`` as a tensor; lists through numpy, as torch would make their floats float32 before the range check
    and the cast to the input dtype, torch's error where numpy fails (it names a ragged row's length).

    An array torch cannot share (a view with negative strides, ``x[::-1]`` or ``np.flip(x)``; bytes in the
    other byte order, ``x.astype('>f4')`` or a file's) is copied into one it can, its values unchanged.
    """
    if isinstance(batch, torch.Tensor):
        return batch
    try:
        array = np.asarray(batch)
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        if any(stride < 0 for stride in array.strides):
            array = array.copy()
        return torch.as_tensor(array)
    except (TypeError, ValueError, RuntimeError):
        return torch.as_tensor(batch)
