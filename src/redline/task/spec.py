"""Loading a Task from a spec string: ``example:NAME``, ``pkg.module:factory`` or ``path/to/file.py:factory``."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from redline.errors import RedlineError, TaskSpecError, few, nearest, user_line, users_file
from redline.task.definition import Task

EXAMPLES = {
    "digits": "redline.examples.digits:digits",
    "chargpt": "redline.examples.chargpt:chargpt",
}


def load_task(spec: str, **options: Any) -> Task:
    """Load a Task from a spec string, passing ``options`` to the factory as keywords.

    Forms: ``example:digits`` or ``example:chargpt``; ``pkg.module:factory``;
    ``path/to/file.py:factory``.
    """
    return call_factory(spec, find_factory(spec), options)


def find_factory(spec: str) -> Callable[..., Any]:
    """Import the module a spec string names and return its factory (a TaskSpecError says what is wrong)."""
    module_name, factory_name = _split_spec(spec)
    module = _import_module(spec, module_name)
    factory = getattr(module, factory_name, None)
    if isinstance(factory, Task):  # a Task the module built as it was imported: taken as it is
        return BuiltTask(factory, factory_name)
    if factory is None or not callable(factory):
        public = {n: v for n, v in vars(module).items() if callable(v) and not n.startswith("_")}
        own = sorted(n for n, v in public.items() if getattr(v, "__module__", None) == module.__name__)
        shown = own or sorted(public)  # what the file defines, not what it imported (torch's classes, say)
        shown = sorted([*shown, *(n for n, v in vars(module).items() if isinstance(v, Task) and not n.startswith("_"))])
        near = nearest(factory_name, shown)
        hint = f"did you mean '{spec.rsplit(':', 1)[0]}:{near}'?" if near else "name a function that returns a Task"
        hint = _shadowed(module_name, module, factory_name) or hint
        what = f"has no callable {factory_name!r}"
        if factory is not None:  # there, and no factory: a number, a dataset
            what = f"defines {factory_name!r} as a value of type {type(factory).__name__}, not a Task or its factory"
            hint = hint if near and near != factory_name else "name a function that returns a Task, or a Task"
        listed = few(shown, 12) if shown else "none"
        raise TaskSpecError(f"task spec {spec!r}: {module_name} {what}; defined there: {listed}\nhint: {hint}")
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
    object.__setattr__(task, "_origin", (_absolute(spec), dict(options)))  # frozen: as a __post_init__ would set it
    return task


def _absolute(spec: str) -> str:
    """``spec`` with a task file's path made absolute: loaded again after a chdir, it names the same file."""
    module_name, _, factory = spec.rpartition(":")
    path = _task_file(module_name)
    return f"{path.resolve()}:{factory}" if path is not None else spec


def _task_file(module_name: str) -> Path | None:
    """The file a spec's module part names (``path/to/tasks.py``, ``~/tasks.py``); None for a dotted module."""
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        return Path(os.path.expanduser(module_name))  # ~nosuchuser stays as given
    return None


def task_origin(task: Task) -> tuple[str, dict[str, Any]] | None:
    """The spec and options that loaded ``task`` (None for a Task built in Python, or copied with other fields): what
    loads the same Task again in another process (`redline bench --isolate`'s rows)."""
    origin = vars(task).get("_origin")
    return origin if isinstance(origin, tuple) else None


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
    check_options(spec, factory, options)
    try:
        return factory(**options)
    except TaskSpecError:
        raise
    except RedlineError as exc:  # a refusal of what it built (an empty train_data): its own hint is the fix
        said, _, hint = str(exc).partition("\nhint: ")
        where = _where(exc) if not hint else user_line(exc) + f"\nhint: {hint}"
        raise TaskSpecError(f"task spec {spec!r}: the factory raised {type(exc).__name__}: {said}{where}") from exc
    except Exception as exc:
        raise TaskSpecError(f"task spec {spec!r}: the factory raised {type(exc).__name__}: {exc}{_where(exc)}") from exc


FORMS = "'example:NAME' (NAME in: {}), 'pkg.module:factory' or 'path/to/file.py:factory'"


def _split_spec(spec: str) -> tuple[str, str]:
    forms = FORMS.format(", ".join(EXAMPLES))
    if not isinstance(spec, str) or ":" not in spec:
        raise TaskSpecError(f"task spec {spec!r} has no ':'; expected {forms}{_spec_hint(spec)}")
    head, _, tail = spec.rpartition(":")  # the last ':': a Windows path has one of its own (C:\tasks.py:make)
    if head.startswith("example:"):  # 'example:digits:extra': the example is the part after the first ':'
        name = head.split(":")[1]
        hint = f"\nhint: did you mean 'example:{name}'?" if name in EXAMPLES else ""
        raise TaskSpecError(f"task spec {spec!r} has more than one ':'; expected {forms}{hint}")
    if _names_a_factory_twice(head):  # 'tasks.py:make:x': the file was looked for as 'tasks.py:make', and not found
        raise TaskSpecError(f"task spec {spec!r} has more than one ':'; expected {forms}{_meant_hint(head)}")
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


def _names_a_factory_twice(head: str) -> bool:
    """Whether ``head``, a spec before its last ':', ends in a factory of its own ('tasks.py:make'), not in a path
    with a ':' ('run:1/tasks.py', a timestamped run folder, which is looked for as a file)."""
    if ":" not in head[_drive(head) :] or Path(os.path.expanduser(head)).is_file():
        return False
    return head.rpartition(":")[2].isidentifier()


def _meant_hint(head: str) -> str:
    """The spec meant by one with a second factory, ``head`` the part before its last ':'."""
    where = head.rpartition(":")[0]
    if ":" in where[_drive(where) :] and not Path(os.path.expanduser(where)).is_file():  # 'tasks.py:make:x:y'
        drive = _drive(head)
        where, _, rest = head[drive:].partition(":")
        head = f"{head[:drive]}{where}:{rest.partition(':')[0]}"
    return f"\nhint: did you mean '{head}'?" if where and head.rpartition(":")[2].isidentifier() else ""


def _drive(path: str) -> int:
    """How many characters of ``path`` a Windows drive takes (2 for C:\\ or C:/), whose ':' is no spec's."""
    return 2 if len(path) > 2 and path[0].isalpha() and path[1] == ":" and path[2] in "\\/" else 0


def _spec_hint(spec: object) -> str:
    """The fix for a spec without its ':': the example it names, or the factory a file needs."""
    if not isinstance(spec, str):
        return ""
    if spec in EXAMPLES:
        return f"\nhint: the built-in example is 'example:{spec}'"
    dotted = _dotted_factory(spec)
    if dotted:
        return f"\nhint: did you mean '{dotted}'?"
    if spec and not spec.endswith(".py") and Path(os.path.expanduser(f"{spec}.py")).is_file():
        spec += ".py"  # 'tasks' where tasks.py lies: the file's factory is meant
    if spec.endswith(".py") or "." in spec:
        defined = _functions_in(Path(os.path.expanduser(spec))) if spec.endswith(".py") else []
        if len(defined) == 1:
            return f"\nhint: did you mean '{spec}:{defined[0]}'?"
        if defined:
            return f"\nhint: name the function that returns the Task (or model), one of: {few(defined, 6)}"
        return f"\nhint: add the function that returns the Task (or model), e.g. '{spec}:make_task'"
    near = nearest(spec, EXAMPLES)
    return f"\nhint: did you mean 'example:{near}'?" if spec and near else ""


def _dotted_factory(spec: str) -> str:
    """The spec a factory named with a dot meant (``tasks.make`` -> ``tasks:make``) where the file of the part before
    the last dot defines it; "" if not."""
    module, _, name = spec.rpartition(".")
    if not module or not name.isidentifier() or module.endswith(".py"):
        return ""
    if "/" in module or "\\" in module:  # a path: its file spec
        file, meant = Path(f"{module}.py"), f"{module}.py:{name}"
    elif not all(part.isidentifier() for part in module.split(".")):  # '..make', 'a..make': no module's name
        return ""
    else:
        file, meant = Path(*module.split(".")).with_suffix(".py"), f"{module}:{name}"
        file = file if file.is_file() else file.with_suffix("") / "__init__.py"
    return meant if name in _functions_in(Path(os.path.expanduser(file))) else ""


def _functions_in(path: Path) -> list[str]:
    """The public functions a Python file defines at its top level, read without running it ([] if unreadable)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return []
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]


def _import_module(spec: str, module_name: str) -> Any:
    path = _task_file(module_name)
    if path is not None:
        if not path.is_file():
            factory = spec.rpartition(":")[2]
            files = sorted(f"'{f}:{factory}'" for f in path.glob("*.py")) if path.is_dir() else []
            hint = f"\nhint: name the file in it, one of: {few(files, 4)}" if files else ""
            if not path.is_dir():
                beside = [f.name for f in path.parent.glob("*.py")] if path.parent.is_dir() else []
                near = nearest(path.name, beside)
                hint = f"\nhint: a relative path is read from {Path.cwd()}; `example:digits` names a built-in task"
                if near:
                    hint = f"\nhint: did you mean '{path.parent / str(near)}:{factory}'?"
            said = "folder {!r} is not a Python file" if path.is_dir() else "file {!r} does not exist"
            raise TaskSpecError(f"task spec {spec!r}: {said.format(str(path))}{hint}")
        return _import_file(spec, path)
    _search_folder()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name != exc.name and not module_name.startswith(exc.name + "."):
            raise _missing_module(spec, module_name, exc) from exc
        top, _, rest = module_name.partition(".")
        hint = f"run redline in the folder that holds {top}/ (or {top}.py), or pip install the package"
        if rest and exc.name != top and (Path.cwd() / top).is_dir():  # the folder is here: its module is not
            modules = sorted(f.stem for f in (Path.cwd() / top).glob("*.py"))
            near = nearest(rest, modules)
            hint = f"{top}/ is here, but holds no {rest.replace('.', '/')}.py" + (
                f": did you mean '{top}.{near}:{spec.rpartition(':')[2]}'?" if near else ""
            )
        raise TaskSpecError(
            f"task spec {spec!r}: module {module_name!r} not found ({exc}); "
            f"expected {FORMS.format(', '.join(EXAMPLES))}\nhint: {hint}"
        ) from exc
    except SystemExit as exc:
        raise _exited(spec, module_name, exc) from exc
    except Exception as exc:
        raise TaskSpecError(
            f"task spec {spec!r}: importing {module_name!r} raised {_as_raised(exc)}{_where(exc)}"
        ) from exc


def _as_raised(exc: BaseException) -> str:
    """An exception of the user's import as its message says it: ``SyntaxError: invalid syntax (tasks.py, line 3)``,
    not the repr of its arguments."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


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


def _import_file(spec: str, path: Path) -> Any:
    """Import the task file ``path`` as ``python file.py`` would, its own folder first."""
    _search_folder(path.resolve().parent, first=True)  # its own imports of the modules beside it
    name = _file_module_name(path.resolve())
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
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            raise _missing_module(spec, str(path), exc, beside=path.resolve().parent) from exc
        if _relative_import(exc, path):
            raise TaskSpecError(
                f"task spec {spec!r}: importing {str(path)!r} raised {_as_raised(exc)}{user_line(exc)}\n"
                f"hint: {_package_hint(path, spec.rpartition(':')[2])}"
            ) from exc
        raise TaskSpecError(
            f"task spec {spec!r}: importing {str(path)!r} raised {_as_raised(exc)}{_where(exc)}"
        ) from exc
    return module


def _relative_import(exc: BaseException, path: Path) -> bool:
    """Whether ``exc`` is the task file's own relative import (``from .models import net``) failing: a file imported
    by its path is no module of a package, so it has nothing to import relative to."""
    if not isinstance(exc, ImportError) or isinstance(exc, ModuleNotFoundError) or "relative import" not in str(exc):
        return False
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if users_file(frame.filename)]
    return bool(frames) and Path(frames[-1].filename).resolve() == path.resolve()


def _package_hint(path: Path, factory: str) -> str:
    """The fix for a task file's relative import: its module spec where the file is in a package (``mypkg/tasks.py``
    -> ``mypkg.tasks:make``), run from the folder that holds the package; else an absolute import."""
    parts, root = [path.stem] if path.stem != "__init__" else [], path.resolve().parent
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    if root == path.resolve().parent:  # no package: its folder is searched first, so `from models import` finds it
        return f"{path.name} is in no package (no __init__.py beside it): import absolutely, `from models import ...`"
    try:
        here = root.samefile(Path.cwd())
    except OSError:  # no working directory left
        here = False
    where = "" if here else f", with redline run in {str(root)!r}"
    return f"{path.name} is a module of the package {parts[0]!r}: name it as one, '{'.'.join(parts)}:{factory}'{where}"


def _missing_module(spec: str, imported: str, exc: ModuleNotFoundError, beside: Path | None = None) -> TaskSpecError:
    """The error for a task module or file that imports a module not found: a package this environment lacks (or,
    for a file, a module that is not ``beside`` it either; for a module spec, one beside its file, which only a file
    spec finds), or, where its package is there, a misspelt submodule (``torch.nn.functionals``), which is the task's
    own line to fix."""
    missing = str(exc.name)
    top = missing.partition(".")[0]
    try:
        installed = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec
        installed = True
    if installed:
        return TaskSpecError(f"task spec {spec!r}: importing {imported!r} raised {_as_raised(exc)}{_where(exc)}")
    file = _module_file(imported) if beside is None else None  # a module spec: the file it names
    local_module = next((name for name in (f"{top}.py", f"{top}/") if file and (file.parent / name).exists()), None)
    if file is not None and local_module is not None:
        try:
            shown = file.relative_to(Path.cwd())
        except (ValueError, OSError):
            shown = file
        hint = (
            f"{local_module} lies beside {file.name}, whose folder is searched first only for a file given by its "
            f"path: give the file, '{shown}:{spec.rpartition(':')[2]}'"
        )
    else:
        local = f", or put {top}.py (or {top}/) in {str(beside)!r} beside it" if beside is not None else ""
        hint = f"pip install the package that provides {top!r}{local}"
    return TaskSpecError(
        f"task spec {spec!r}: importing {imported!r} failed: it imports {missing!r}, which is not installed"
        f"{user_line(exc)}\nhint: {hint}"
    )


def _module_file(module_name: str) -> Path | None:
    """The file a module spec's module is read from, found without importing it (None if not known)."""
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError, AttributeError):
        return None
    origin = found.origin if found is not None else None
    return Path(origin).resolve() if origin and Path(origin).is_file() else None


def _exited(spec: str, what: str, exc: SystemExit) -> TaskSpecError:
    """A module that ends the process while imported: a script's top level (argument parsing, say) ran."""
    return TaskSpecError(
        f"task spec {spec!r}: importing {what!r} exited (SystemExit: {exc.code!r}); its top-level code ran, as a "
        "script's does\nhint: put the script's own code under `if __name__ == '__main__':`, or move the factory "
        "to a module of its own"
    )


def _file_module_name(path: Path) -> str:
    """The name a task file is imported under: its own, as ``import name`` from its folder finds it, so that loader
    workers started by spawn or forkserver (macOS; Linux from Python 3.14) can import the classes it defines; a
    made-up one where that name means another module (the standard library's, another file's, a package's)."""
    stem = path.stem
    if stem.isidentifier() and stem not in sys.stdlib_module_names:
        found = importlib.machinery.PathFinder.find_spec(stem, [str(path.parent)])
        finds_it = found is not None and found.origin is not None and Path(found.origin).resolve() == path
        loaded = sys.modules.get(stem)
        free = loaded is None or Path(getattr(loaded, "__file__", None) or "/").resolve() == path
        if finds_it and free:
            return stem
    return f"redline_task_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def _search_folder(folder: Path | None = None, *, first: bool = False) -> None:
    """Let a dotted spec name a module in the working directory, as it does under ``python -m redline``; with
    ``folder`` (a task file's) and ``first``, let the file import the modules beside it, as ``python file.py`` does.

    The ``redline`` console script's sys.path starts with the script's own folder, where
    ``python -m`` puts the working directory. That goes last here, so that an installed package of
    the same name still comes first; a task file's folder goes first, as Python puts a script's.
    """
    try:
        where = str(folder) if folder is not None else os.getcwd()
    except OSError:  # the working directory was removed
        return
    if first:
        if not sys.path or os.path.realpath(sys.path[0] or os.curdir) != os.path.realpath(where):
            sys.path.insert(0, where)
        return
    searched = {os.path.realpath(entry or os.curdir) for entry in sys.path if isinstance(entry, str)}
    if os.path.realpath(where) not in searched:
        sys.path.append(where)


class BuiltTask:
    """A Task a module built as it was imported (``file.py:TASK``), standing where a factory would: it takes no
    options."""

    def __init__(self, task: Task, name: str) -> None:
        self.task, self.name = task, name

    def __call__(self) -> Task:
        return self.task


def check_options(spec: str, factory: Callable[..., Any], options: dict[str, Any]) -> None:
    """Raise the TaskSpecError calling ``factory(**options)`` would for its options (required, unknown), without
    calling it."""
    if isinstance(factory, BuiltTask) and options:
        raise TaskSpecError(
            f"task spec {spec!r}: {factory.name} is a Task built at import; it takes no --task-arg (given: "
            f"{', '.join(sorted(options))})\nhint: drop the --task-arg, or make {factory.name} a function that takes "
            "it as a parameter and returns the Task"
        )
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
