"""The Task: a workload's model, loss, data, optimizer factory and batch size, checked when it is made."""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import os
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from redline.config import call_refused, positive_int
from redline.errors import ConfigError, invalid
from redline.task.meta import on_meta

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
CollateFn = Callable[[list[Any]], Any]  # a list of items -> a batch, as a DataLoader's collate_fn


@dataclass(frozen=True, kw_only=True)
class Task:
    """A training workload: model, loss, data, optimizer factory and batch size.

    ``model`` is a module, or a zero-argument callable returning a fresh one; tools that need a fresh
    copy call ``build_model()``. ``loss_fn(outputs, targets)`` returns a scalar tensor. Each item of
    ``train_data`` is ``(inputs, targets)``. ``metric(outputs, targets)`` returns a float where higher
    is better (accuracy, say); ``sample(model)`` returns text that shows what the model learned.
    ``epochs`` is how long the task trains by default. ``collate_fn(items)`` builds a batch from a list
    of items, as a DataLoader's does (padding sequences of different lengths, say); without it items
    are stacked.
    """

    model: nn.Module | Callable[[], nn.Module]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    train_data: Dataset[Any]
    val_data: Dataset[Any] | None = None
    optimizer: OptimizerFactory = lambda params: torch.optim.AdamW(params, lr=1e-3)
    batch_size: int = 64
    scheduler: SchedulerFactory | None = None
    metric: Callable[[Any, Any], float] | None = None
    sample: Callable[[nn.Module], str] | None = None
    collate_fn: CollateFn | None = None
    epochs: int = 1
    name: str = "task"

    def __post_init__(self) -> None:
        if not (isinstance(self.model, nn.Module) or callable(self.model)):
            raise invalid(
                "model", _shown(self.model), "an nn.Module or a callable returning one", "model=MyNet() or model=MyNet"
            )
        if not isinstance(self.model, nn.Module):
            _check_model_factory(self.model)
        _check_data("train_data", self.train_data, collated=self.collate_fn is not None)
        if self.val_data is not None:
            _check_data("val_data", self.val_data, collated=self.collate_fn is not None)
        if not callable(self.optimizer) or isinstance(self.optimizer, torch.optim.Optimizer):
            raise invalid(
                "optimizer",
                _shown(self.optimizer),
                "a factory params -> Optimizer",
                f"write {_ADAMW}",
            )
        if why := call_refused(self.optimizer, 1):
            raise invalid("optimizer", _shown(self.optimizer), "a factory params -> Optimizer", f"{why}; e.g. {_ADAMW}")
        for name, (signature, example) in _FUNCTIONS.items():
            _check_function(name, getattr(self, name), signature, example)
        positive_int("batch_size", self.batch_size)
        positive_int("epochs", self.epochs)
        if not isinstance(self.name, str) or not self.name.strip():
            raise invalid("name", _shown(self.name), "a non-empty string", 'e.g. name="digits"')

    def build_model(self) -> nn.Module:
        """Return a fresh model: the factory's result, or a deep copy of the given module."""
        if isinstance(self.model, nn.Module):
            try:
                return copy.deepcopy(self.model)
            except Exception as exc:  # a lock, an open file, a C handle held in an attribute
                kind = type(self.model).__name__
                raise invalid(
                    "model",
                    _shown(self.model),
                    f"a module that can be copied (every fit, trial and bench starts from a copy of it; "
                    f"copying it raised {type(exc).__name__}: {exc})",
                    f"pass the factory that builds it instead: model=lambda: {kind}(...), or model={kind} where it "
                    "takes no arguments",
                ) from exc
        model = self.model()
        if not isinstance(model, nn.Module):
            fix = "return the module it builds (model=lambda: MyNet(...)), or pass the module itself as model="
            if model is None:
                fix = "the factory returns nothing: end it with `return model`, the module it built"
            elif isinstance(model, type) and issubclass(model, nn.Module):
                fix = f"it returned the class: return an instance, {model.__name__}(...)"
            shown = f"a {type(model).__name__}" if isinstance(_shown(model), _Kind) else f"{model!r}"
            shown = f"the class {model.__name__}" if isinstance(model, type) else shown
            raise ConfigError(f"the model factory returned {shown}, not an nn.Module\nhint: {fix}")
        return model

    def outline(self) -> nn.Module:
        """The model to read the structure of (its modules, names, shapes, dtypes; never its weights' values): the
        given module itself, or the factory's built on the meta device, or for real where it cannot build there."""
        # on meta, GPT-2 small's took 0.85 s the first time (torch's meta kernels loading), 0.03 s after, and no
        # weights; for real, 1.9 s and its weights' 0.5 GB
        return self.model if isinstance(self.model, nn.Module) else on_meta(self.build_model) or self.build_model()

    def fingerprint(self) -> str:
        """Return a short hash of what shapes the workload: model structure, parameters, loss, optimizer, data.

        The model counts by its structure, its own modules' forward code and settings (``model_fingerprint``); the loss
        and the collate_fn by their name and their code (``_code_digest``): two lambdas of one file, or a loss whose
        body was edited, are two workloads. Neither counts by the code they call (a helper, a method), nor by values
        they keep elsewhere (a closure's, a tensor's).
        The data counts by its size and the shapes and dtypes of its first sample (not its values): a
        model that takes any image size runs another workload on larger images. A stream (no length)
        is not read here. The optimizer counts by its kind and its switches (fused, foreach, amsgrad,
        ...), not its learning rate or other numbers: a sweep over them is one workload to time. A factory's model
        is built on the meta device (its weights' values are not read, and take no memory there; ``meta.on_meta``),
        or for real where the factory cannot build there. The Task's batch size is left out: a trial's and a tune's
        keys add the batch the run uses, given to the run (``--batch-size``) or to the Task alike.
        """
        model = self.outline()
        digest = hashlib.sha256()
        digest.update(model_fingerprint(model).encode())
        digest.update(f"loss={_function_identity(self.loss_fn)}".encode())
        if self.collate_fn is not None:  # padding to the longest item shapes the batch: another workload
            digest.update(f"collate={_function_identity(self.collate_fn)}".encode())
        digest.update(f"optimizer={_optimizer_kind(self.optimizer, model)}".encode())
        size = len(self.train_data) if hasattr(self.train_data, "__len__") else -1
        digest.update(f"train={size}".encode())
        if size > 0 and not isinstance(self.train_data, IterableDataset):
            digest.update(f"sample={_layout(self.train_data[0])}".encode())
        return digest.hexdigest()[:16]


def model_fingerprint(model: nn.Module, *, settings: bool = True, code: bool = True) -> str:
    """A short hash of a model's structure, its tensors' names, shapes and dtypes (not their values), the code of its
    own modules' forwards (``_forward_code``; left out with ``code=False``: bytecode differs between Python
    versions), its modules' settings (``_settings``; left out with ``settings=False``), and which of its parameters
    are frozen: a linear probe of a model has little of its full fine-tuning's backward and optimizer."""
    digest = hashlib.sha256()
    digest.update(repr(model).encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    for name, module in model.named_modules() if code else ():
        digest.update(f"{name}:{_forward_code(module)}".encode())
    for name, module in model.named_modules() if settings else ():
        digest.update(f"{name}:{_settings(module)}".encode())
    frozen = [name for name, parameter in model.named_parameters() if not parameter.requires_grad]
    if frozen:  # said only where some are: a model trained whole keeps the hash it had
        digest.update(f"frozen={','.join(frozen)}".encode())
    return digest.hexdigest()[:16]


def _settings(module: nn.Module) -> str:
    """A module's public plain attributes by name (numbers, texts, switches, None, and tuples or lists of them), not
    ``training``: the same shapes split into 2 heads or 4 (``self.n_head``, which nn.MultiheadAttention's repr does
    not show either), or through another activation (``self.act = "tanh"``), are another workload to time."""
    return ",".join(
        f"{name}={value!r}"
        for name, value in sorted(vars(module).items())
        if not name.startswith("_") and name != "training" and _plain(value)
    )


def _own_class(module: nn.Module) -> bool:
    """Whether ``module``'s class is not one of torch's own (nn.Linear's is ``torch.nn.modules.linear``)."""
    return not type(module).__module__.startswith("torch.")


def _forward_code(module: nn.Module) -> str:
    """The digest of the code of ``module``'s class's forward, for a class not torch's own ("" for torch's, whose
    code the cache keys' torch version names, and for a forward with no Python code)."""
    code = getattr(type(module).forward, "__code__", None) if _own_class(module) else None
    return _code_digest(code) if isinstance(code, types.CodeType) else ""


def _plain(value: object) -> bool:
    if isinstance(value, tuple | list):
        return all(_plain(item) for item in value)
    return isinstance(value, bool | int | float | str | None)


def _function_identity(fn: object) -> str:
    """A loss function's name and code as they stay from run to run: its module, qualified name and ``_code_digest``
    (a callable object's by its ``__call__``), or a module's repr and forward's code."""
    if isinstance(fn, nn.Module):
        return f"{fn!r}{_forward_code(fn)}"
    if isinstance(fn, functools.partial):
        return f"partial({_function_identity(fn.func)}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    code = _code_of(fn)
    digest = f"@{_code_digest(code)}" if code is not None else ""
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{name}{digest}"


def _code_of(fn: object) -> types.CodeType | None:
    """The Python code a call of ``fn`` runs: a function's or a method's own, a callable object's ``__call__``; None
    for a builtin."""
    call = inspect.getattr_static(type(fn), "__call__", None)
    code = getattr(fn, "__code__", None) or getattr(call, "__code__", None)
    return code if isinstance(code, types.CodeType) else None


@functools.lru_cache(maxsize=4096)
def _code_digest(code: types.CodeType) -> str:
    """A short hash of what ``code`` does, the same in every process of this Python: its bytecode, the names it reads
    and its constants, nested code (a lambda, a comprehension) included; not where it sits (its file and lines) nor
    its variables' names. A code object's repr holds a memory address, so it is never hashed."""
    digest = hashlib.sha256(code.co_code)
    digest.update(f"\x00{code.co_names!r}\x00{_constant(code.co_consts)}".encode())
    return digest.hexdigest()[:16]


def _constant(value: object) -> str:
    """A code object's constant as text that no process's memory addresses or string hashes change."""
    if isinstance(value, types.CodeType):
        return f"<code {_code_digest(value)}>"
    if isinstance(value, tuple):
        return "(" + ",".join(_constant(item) for item in value) + ")"
    if isinstance(value, frozenset):  # ``x in {"a", "b"}``: its order follows string hashes, seeded per process
        return "frozenset(" + ",".join(sorted(_constant(item) for item in value)) + ")"
    if value is None or value is Ellipsis or isinstance(value, bool | int | float | complex | str | bytes | slice):
        return repr(value)
    return type(value).__qualname__  # none other that Python writes; its repr could hold an address


def _optimizer_kind(factory: OptimizerFactory, model: nn.Module) -> str:
    """The kind of optimizer ``factory`` builds on ``model`` and its switches per parameter group (how many tensors,
    fused, foreach, ...). A factory that fails here fails again where the run builds it, with the error that
    names the fix (a model without parameters, say): the fingerprint only notes that it failed."""
    try:
        optimizer = factory(model.parameters())
    except Exception as exc:  # said where the run builds the optimizer
        return f"failed: {type(exc).__name__}"
    groups = [
        (len(group.get("params", ())), sorted((k, v) for k, v in group.items() if isinstance(v, bool | str | None)))
        for group in getattr(optimizer, "param_groups", ())
    ]
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}{groups}"


def _layout(item: object) -> str:
    """The shapes and dtypes of a sample, nested as it is (values left out)."""
    if isinstance(item, torch.Tensor) or (hasattr(item, "shape") and hasattr(item, "dtype")):
        return f"{tuple(item.shape)}:{item.dtype}"
    if isinstance(item, Mapping):
        return "{" + ",".join(f"{k}={_layout(v)}" for k, v in item.items()) + "}"
    if isinstance(item, list | tuple):
        return "(" + ",".join(_layout(v) for v in item) + ")"
    return type(item).__name__


# The Task's function fields: what each is called with and returns, and an example that fits.
_FUNCTIONS = {
    "loss_fn": ("(outputs, targets) -> scalar tensor", "loss_fn=nn.functional.cross_entropy or nn.CrossEntropyLoss()"),
    "scheduler": ("optimizer -> LR scheduler", "scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)"),
    "metric": ("(outputs, targets) -> float", "metric=accuracy, with def accuracy(outputs, targets) -> float"),
    "sample": ("model -> str", "sample=generate, with def generate(model) -> str"),
    "collate_fn": ("list of items -> batch", "collate_fn=pad, with def pad(items) -> (inputs, targets)"),
}


@dataclass(frozen=True)
class _Kind:
    """Stands in a message for a value too long to show: ``train_data=<DataLoader>``."""

    name: str

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _shown(value: object) -> object:
    """Return ``value`` as a message shows it: a short scalar itself, anything else by its type."""
    if isinstance(value, bool | int | float | str | None) and len(repr(value)) <= 60:
        return value
    return _Kind(value.__name__ if isinstance(value, type) else type(value).__name__)


def _check_function(name: str, value: object, signature: str, example: str) -> None:
    if value is None and name != "loss_fn":
        return  # optional
    if isinstance(value, type) and issubclass(value, nn.Module):  # nn.MSELoss, not nn.MSELoss()
        hint = f"pass an instance: {value.__name__}()"
        raise invalid(name, _shown(value), f"a callable {signature}, not a class", hint)
    if not callable(value):
        optional = "" if name == "loss_fn" else ", or None"
        raise invalid(name, _shown(value), f"a callable {signature}{optional}", f"pass the function itself: {example}")
    if why := call_refused(value, _ARITY[name]):
        raise invalid(name, _shown(value), f"a callable {signature}", f"{why}; e.g. {example}")


_ADAMW = "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
_ARITY = {"loss_fn": 2, "scheduler": 1, "metric": 2, "sample": 1, "collate_fn": 1}  # what a run calls each with


def _check_model_factory(factory: Callable[..., Any]) -> None:
    """Refuse a model factory that cannot be called without arguments (``model=nn.Linear``), which would fail
    only when a tool first builds the model, in redline's own frame rather than the user's."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): calling it will tell
        return
    needed = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if needed:
        name = getattr(factory, "__name__", None) or type(factory).__name__
        raise invalid(
            "model",
            _shown(factory),
            f"an nn.Module, or a callable that takes no arguments and returns one ({name} needs {', '.join(needed)})",
            f"pass an instance, model={name}(...), or a factory that fills them in: model=lambda: {name}(...)",
        )


def _check_data(name: str, data: object, *, collated: bool = False) -> None:
    """Refuse what a DataLoader cannot read as a dataset of (inputs, targets) items, saying what to pass;
    ``collated``: the Task has a collate_fn, which may make its pairs of items of another kind."""
    hint, shown = "", _shown(data)
    if isinstance(data, IterableDataset):
        return  # a stream: no length to check
    if isinstance(data, str | bytes | os.PathLike):
        hint = "load the file into a Dataset first, e.g. torch.utils.data.TensorDataset(inputs, targets)"
    elif is_array(data):
        hint = "pair the inputs with their targets: torch.utils.data.TensorDataset(inputs, targets)"
    elif isinstance(data, tuple | list) and data and is_array(data[0]) and not collated:
        # its items are the samples, each a tensor alone, no pair: (inputs, targets) given as they are, most often
        shown = _Kind(f"{type(data).__name__} of {len(data)} {type(data[0]).__name__}s")
        hint = "pair the inputs with their targets: torch.utils.data.TensorDataset(inputs, targets)"
    elif isinstance(data, DataLoader):
        hint = f"pass the loader's dataset ({name}=loader.dataset) and its batch size as batch_size="
    elif isinstance(data, Mapping) and _columns(data):  # {"x": [...], "y": [...]}: Hugging Face's to_dict(), say
        first, second = (repr(key) for key in list(data)[:2])
        hint = (
            f"its values are columns of one length: pair them in a Dataset, e.g. {name}=torch.utils.data."
            f"TensorDataset(torch.tensor(columns[{first}]), torch.tensor(columns[{second}]))"
        )
    elif isinstance(data, Mapping):
        hint = f"pass one split, e.g. {name}=splits['train']"
    elif isinstance(data, Iterator):
        hint = "an iterator is used up after one pass: wrap a stream in a torch.utils.data.IterableDataset"
    elif not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        hint = "give it __getitem__ and __len__ (a torch Dataset), or make it a torch.utils.data.IterableDataset"
    if hint:
        raise invalid(name, shown, "a torch Dataset of (inputs, targets) items", hint)
    if len(data) == 0:  # type: ignore[arg-type]
        raise invalid(f"len({name})", 0, "at least one item", f"check how {name} is built: it holds no samples")


def _columns(data: Mapping[Any, Any]) -> bool:
    """Whether a mapping holds two or more columns of one length (lists, tuples or arrays), not named splits."""
    values = list(data.values())
    if len(values) < 2 or not all(isinstance(v, list | tuple) or is_array(v) for v in values):
        return False
    try:
        return len({len(v) for v in values}) == 1
    except TypeError:  # a zero-dimensional array
        return False


def is_array(value: object) -> bool:
    """Whether ``value`` is a tensor or an array (NumPy's, or another with a shape and a dtype)."""
    return isinstance(value, torch.Tensor) or (hasattr(value, "shape") and hasattr(value, "dtype"))


def require_task(value: object) -> Task:
    """Return ``value`` if it is a Task; else raise the ConfigError that says how to make one."""
    if isinstance(value, Task):
        return value
    if isinstance(value, str):
        raise invalid("task", value, "a redline.Task, not a spec", f"load it first: redline.load_task({value!r})")
    hint = "e.g. redline.load_task('example:digits'), or redline.Task(model=..., loss_fn=..., train_data=..., ...)"
    raise invalid("task", type(value).__name__, "a redline.Task", hint)
