"""Task: the one description of a workload that every redline command understands.

A Task names the model, the loss, the data, the optimizer factory and the batch size. It is built in
Python, or loaded from a spec string: ``example:NAME`` (built in), ``pkg.module:factory`` or
``path/to/file.py:factory``, where ``factory(**options)`` returns a Task.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from redline.config import call_refused, positive_int
from redline.errors import TaskSpecError, few, invalid, nearest, user_line

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
CollateFn = Callable[[list[Any]], Any]  # a list of items -> a batch, as a DataLoader's collate_fn

EXAMPLES = {
    "digits": "redline.examples.digits:digits",
    "chargpt": "redline.examples.chargpt:chargpt",
}


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
        _check_data("train_data", self.train_data)
        if self.val_data is not None:
            _check_data("val_data", self.val_data)
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
            return copy.deepcopy(self.model)
        model = self.model()
        if not isinstance(model, nn.Module):
            raise invalid("model()", type(model).__name__, "the factory to return an nn.Module")
        return model

    def fingerprint(self) -> str:
        """Return a short hash of what shapes the workload: model structure, parameters, loss, optimizer, batch, data.

        The data counts by its size and the shapes and dtypes of its first sample (not its values): a
        model that takes any image size runs another workload on larger images. A stream (no length)
        is not read here. The optimizer counts by its kind and its switches (fused, foreach, amsgrad,
        ...), not its learning rate or other numbers: a sweep over them is one workload to time.
        """
        model = self.model if isinstance(self.model, nn.Module) else self.build_model()
        digest = hashlib.sha256()
        digest.update(model_fingerprint(model).encode())
        digest.update(f"loss={_function_name(self.loss_fn)}".encode())
        if self.collate_fn is not None:  # padding to the longest item shapes the batch: another workload
            digest.update(f"collate={_function_name(self.collate_fn)}".encode())
        digest.update(f"optimizer={_optimizer_kind(self.optimizer, model)}".encode())
        digest.update(f"batch={self.batch_size}".encode())
        size = len(self.train_data) if hasattr(self.train_data, "__len__") else -1
        digest.update(f"train={size}".encode())
        if size > 0 and not isinstance(self.train_data, IterableDataset):
            digest.update(f"sample={_layout(self.train_data[0])}".encode())
        return digest.hexdigest()[:16]


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of a model's structure and its tensors' names, shapes and dtypes (not their values)."""
    digest = hashlib.sha256()
    digest.update(repr(model).encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    return digest.hexdigest()[:16]


def _function_name(fn: object) -> str:
    """A loss function's name as it stays from run to run: its module and qualified name, or a module's repr."""
    if isinstance(fn, nn.Module):
        return repr(fn)
    if isinstance(fn, functools.partial):
        return f"partial({_function_name(fn.func)}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{name}"


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


def _check_data(name: str, data: object) -> None:
    """Refuse what a DataLoader cannot read as a dataset of (inputs, targets) items, saying what to pass."""
    hint = ""
    if isinstance(data, IterableDataset):
        return  # a stream: no length to check
    if isinstance(data, str | bytes | os.PathLike):
        hint = "load the file into a Dataset first, e.g. torch.utils.data.TensorDataset(inputs, targets)"
    elif isinstance(data, torch.Tensor) or (hasattr(data, "shape") and hasattr(data, "dtype")):  # an array
        hint = "pair the inputs with their targets: torch.utils.data.TensorDataset(inputs, targets)"
    elif isinstance(data, DataLoader):
        hint = f"pass the loader's dataset ({name}=loader.dataset) and its batch size as batch_size="
    elif isinstance(data, Mapping):
        hint = f"pass one split, e.g. {name}=splits['train']"
    elif isinstance(data, Iterator):
        hint = "an iterator is used up after one pass: wrap a stream in a torch.utils.data.IterableDataset"
    elif not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        hint = "give it __getitem__ and __len__ (a torch Dataset), or make it a torch.utils.data.IterableDataset"
    if hint:
        raise invalid(name, _shown(data), "a torch Dataset of (inputs, targets) items", hint)
    if len(data) == 0:  # type: ignore[arg-type]
        raise invalid(f"len({name})", 0, "at least one item", f"check how {name} is built: it holds no samples")


def load_task(spec: str, **options: Any) -> Task:
    """Load a Task from a spec string, passing ``options`` to the factory as keywords.

    Forms: ``example:digits`` or ``example:chargpt``; ``pkg.module:factory``;
    ``path/to/file.py:factory``.
    """
    return call_factory(spec, find_factory(spec), options)


def check_spec(spec: str, **options: Any) -> None:
    """Raise the TaskSpecError ``load_task`` would for a spec or its options, without running the factory
    (a launcher checks once, before it starts workers that would each fail the same way)."""
    _check_options(spec, find_factory(spec), options)


def require_task(value: object) -> Task:
    """Return ``value`` if it is a Task; else raise the ConfigError that says how to make one."""
    if isinstance(value, Task):
        return value
    if isinstance(value, str):
        raise invalid("task", value, "a redline.Task, not a spec", f"load it first: redline.load_task({value!r})")
    hint = "e.g. redline.load_task('example:digits'), or redline.Task(model=..., loss_fn=..., train_data=..., ...)"
    raise invalid("task", type(value).__name__, "a redline.Task", hint)


def find_factory(spec: str) -> Callable[..., Any]:
    """Import the module a spec string names and return its factory (a TaskSpecError says what is wrong)."""
    module_name, factory_name = _split_spec(spec)
    module = _import_module(spec, module_name)
    factory = getattr(module, factory_name, None)
    if factory is None or not callable(factory):
        public = {n: v for n, v in vars(module).items() if callable(v) and not n.startswith("_")}
        own = sorted(n for n, v in public.items() if getattr(v, "__module__", None) == module.__name__)
        shown = own or sorted(public)  # what the file defines, not what it imported (torch's classes, say)
        near = nearest(factory_name, shown)
        hint = f"did you mean '{spec.rsplit(':', 1)[0]}:{near}'?" if near else "name a function that returns a Task"
        hint = _shadowed(module_name, module, factory_name) or hint
        raise TaskSpecError(
            f"task spec {spec!r}: {module_name} has no callable {factory_name!r}; "
            f"defined there: {', '.join(shown[:12]) or 'none'}\nhint: {hint}"
        )
    return factory


def _shadowed(module_name: str, module: Any, factory_name: str) -> str:
    """The fix when a module of the working directory lost its name to an installed one (``random.py``): "" if not."""
    try:
        local = Path(*module_name.split("."))
        file = next(f for f in (local.with_suffix(".py"), local / "__init__.py") if f.is_file())
    except (StopIteration, OSError):  # none there (or no working directory left)
        return ""
    imported = getattr(module, "__file__", None)
    if imported is not None and Path(imported).resolve() == file.resolve():
        return ""
    which = f"the installed {module_name!r} ({imported})" if imported else f"Python's built-in {module_name!r}"
    return f"{which} comes before {file} of the working directory: give the file, '{file}:{factory_name}', or rename it"


def call_factory(spec: str, factory: Callable[..., Any], options: dict[str, Any]) -> Task:
    """Call ``factory(**options)`` and check that it returns a Task; ``spec`` names it in errors."""
    task = run_factory(spec, factory, options)
    if not isinstance(task, Task):
        raise TaskSpecError(
            f"task spec {spec!r}: the factory returned {type(task).__name__}, expected a redline.Task\n"
            f"hint: {_returned_hint(task)}"
        )
    return task


def _returned_hint(made: object) -> str:
    """The fix for a factory that returned ``made`` where a Task was due."""
    wrap = "return redline.Task(model=..., loss_fn=..., train_data=..., batch_size=...) from the factory"
    if made is None:
        return f"the factory returns nothing: end it with {wrap.removesuffix(' from the factory')}"
    if isinstance(made, nn.Module):  # a model factory, as `redline serve` takes
        return f"a model alone cannot be trained or timed: {wrap}, with model= the module it builds"
    return wrap


def run_factory(spec: str, factory: Callable[..., Any], options: dict[str, Any]) -> Any:
    """Call ``factory(**options)`` with its options checked; what it raises becomes a TaskSpecError naming ``spec``."""
    _check_options(spec, factory, options)
    try:
        return factory(**options)
    except TaskSpecError:
        raise
    except Exception as exc:
        raise TaskSpecError(f"task spec {spec!r}: the factory raised {type(exc).__name__}: {exc}{_where(exc)}") from exc


FORMS = "'example:NAME' (NAME in: {}), 'pkg.module:factory' or 'path/to/file.py:factory'"


def _split_spec(spec: str) -> tuple[str, str]:
    forms = FORMS.format(", ".join(EXAMPLES))
    if not isinstance(spec, str) or ":" not in spec:
        raise TaskSpecError(f"task spec {spec!r} has no ':'; expected {forms}{_spec_hint(spec)}")
    head, _, tail = spec.rpartition(":")
    if head == "example":
        if tail not in EXAMPLES:
            near = nearest(tail, EXAMPLES)
            hint = f"\nhint: did you mean 'example:{near}'?" if near else ""
            raise TaskSpecError(f"task spec {spec!r}: no built-in example {tail!r}; expected {forms}{hint}")
        head, _, tail = EXAMPLES[tail].partition(":")
    if not head or not tail.isidentifier():  # a stray space, or the factory left out ('tasks.py:')
        near = f"\nhint: did you mean '{head.strip()}:{tail.strip()}'?" if head and tail.strip().isidentifier() else ""
        raise TaskSpecError(f"task spec {spec!r} is malformed; expected {forms}{near or _spec_hint(head.strip())}")
    return head, tail


def _spec_hint(spec: object) -> str:
    """The fix for a spec without its ':': the example it names, or the factory a file needs."""
    if not isinstance(spec, str):
        return ""
    if spec in EXAMPLES:
        return f"\nhint: the built-in example is 'example:{spec}'"
    if spec.endswith(".py") or "." in spec:
        defined = _functions_in(Path(spec).expanduser()) if spec.endswith(".py") else []
        if len(defined) == 1:
            return f"\nhint: did you mean '{spec}:{defined[0]}'?"
        if defined:
            return f"\nhint: name the function that returns the Task (or model), one of: {few(defined, 6)}"
        return f"\nhint: add the function that returns the Task (or model), e.g. '{spec}:make_task'"
    return ""


def _functions_in(path: Path) -> list[str]:
    """The public functions a Python file defines at its top level, read without running it ([] if unreadable)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return []
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]


def _import_module(spec: str, module_name: str) -> Any:
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        path = Path(module_name).expanduser()
        if not path.is_file():
            files = sorted(f"'{f}:{spec.rpartition(':')[2]}'" for f in path.glob("*.py")) if path.is_dir() else []
            hint = f"\nhint: name the file in it, one of: {few(files, 4)}" if files else ""
            said = "folder {!r} is not a Python file" if path.is_dir() else "file {!r} does not exist"
            raise TaskSpecError(f"task spec {spec!r}: {said.format(str(path))}{hint}")
        name = f"redline_task_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
        file_spec = importlib.util.spec_from_file_location(name, path)
        if file_spec is None or file_spec.loader is None:
            raise TaskSpecError(f"task spec {spec!r}: cannot import {str(path)!r} as Python")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[name] = module
        try:
            file_spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:
            sys.modules.pop(name, None)
            if isinstance(exc, SystemExit):
                raise _exited(spec, str(path), exc) from exc
            raise TaskSpecError(f"task spec {spec!r}: importing {str(path)!r} raised {exc!r}{_where(exc)}") from exc
        return module
    _search_working_directory()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name != exc.name and not module_name.startswith(exc.name + "."):
            raise TaskSpecError(
                f"task spec {spec!r}: importing {module_name!r} failed: it imports {exc.name!r}, which is "
                f"not installed\nhint: pip install the package that provides {exc.name!r}"
            ) from exc
        top = module_name.partition(".")[0]
        raise TaskSpecError(
            f"task spec {spec!r}: module {module_name!r} not found ({exc}); "
            f"expected {FORMS.format(', '.join(EXAMPLES))}\nhint: run redline in the folder that holds "
            f"{top}/ (or {top}.py), or pip install the package"
        ) from exc
    except SystemExit as exc:
        raise _exited(spec, module_name, exc) from exc
    except Exception as exc:
        raise TaskSpecError(f"task spec {spec!r}: importing {module_name!r} raised {exc!r}{_where(exc)}") from exc


def _where(exc: BaseException) -> str:
    """The line of the user's code that raised ``exc``, and the hint to look there; "" when none is known."""
    if isinstance(exc, SyntaxError):  # raised by the compiler: no frame of the file's own
        line = f"\n  at {exc.filename}:{exc.lineno}: {(exc.text or '').strip()}" if exc.filename else ""
    else:
        line = user_line(exc)
    if not line or line.startswith("\n  at <"):  # Python's own frozen import machinery
        return ""
    return (
        f"{line}\nhint: the error is in the task's own code, at the line shown (REDLINE_TRACEBACK=1 prints the "
        "whole traceback; in Python it is the error's __cause__)"
    )


def _exited(spec: str, what: str, exc: SystemExit) -> TaskSpecError:
    """A module that ends the process while imported: a script's top level (argument parsing, say) ran."""
    return TaskSpecError(
        f"task spec {spec!r}: importing {what!r} exited (SystemExit: {exc.code!r}); its top-level code ran, as a "
        "script's does\nhint: put the script's own code under `if __name__ == '__main__':`, or move the factory "
        "to a module of its own"
    )


def _search_working_directory() -> None:
    """Let a dotted spec name a module in the working directory, as it does under ``python -m redline``.

    The ``redline`` console script's sys.path starts with the script's own folder, where
    ``python -m`` puts the working directory. It goes last here, so that an installed package of
    the same name still comes first.
    """
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was removed
        return
    searched = {os.path.realpath(entry or os.curdir) for entry in sys.path if isinstance(entry, str)}
    if os.path.realpath(cwd) not in searched:
        sys.path.append(cwd)


def _check_options(spec: str, factory: Callable[..., Any], options: dict[str, Any]) -> None:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    named = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    missing = [n for n in named if params[n].default is inspect.Parameter.empty and n not in options]
    if missing:
        flags = " ".join(f"--task-arg {n}=VALUE" for n in missing)
        raise TaskSpecError(
            f"task spec {spec!r}: the factory requires {', '.join(missing)}, and no value was given\n"
            f"hint: pass {flags} (in Python, {missing[0]}=... as a keyword)"
        )
    if not options or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(options) - set(named))
    if unknown:
        near = nearest(unknown[0], named)
        hint = f"did you mean {near}?" if near else "drop it, or add it as a parameter of the factory"
        raise TaskSpecError(
            f"task spec {spec!r}: unknown option(s) {', '.join(unknown)}; "
            f"the factory accepts: {', '.join(named) or 'no options'}\nhint: {hint}"
        )
