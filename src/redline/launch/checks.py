"""What `redline launch` refuses before any worker starts: a script or module Python cannot run, a meeting
place the workers could never reach. Each would otherwise fail on every worker alike, after a rendezvous,
or leave the workers waiting for minutes."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import pkgutil
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from redline.errors import ConfigError, few, invalid, nearest

if TYPE_CHECKING:
    from collections.abc import Sequence

    from redline.launch.torchrun import LaunchConfig


def check_script(script: Path) -> None:
    """Refuse a script Python cannot run before any worker starts: else every worker fails alike, after a rendezvous.

    As ``python SCRIPT`` does, a file runs (a zip application too) and so does a directory with a ``__main__.py``.
    """
    if script.is_file() or (script / "__main__.py").is_file():
        return
    if script.is_dir():
        files = sorted(str(path) for path in script.glob("*.py"))
        which = f"one of its Python files ({few(files, 3)})" if files else "the path of a Python file"
        raise ConfigError(
            f"script {str(script)!r} is a directory without a __main__.py: Python cannot run it\n"
            f"hint: pass {which}, or add a __main__.py to the directory"
        )
    raise ConfigError(
        f"script {str(script)!r} does not exist (looked in {Path.cwd()})\n"
        "hint: pass the path of a Python file, or --module (-m) with a module name"
    )


def check_module(name: str) -> None:
    """Refuse a module ``python -m`` cannot find before any worker starts: else every worker fails alike.

    Only the top-level name is looked for (where the workers' ``python -m`` looks: this directory, then
    Python's path), so nothing is imported here; a submodule that is not there is the workers' to say.
    """
    top = name.split(".")[0]
    try:
        spec = importlib.util.find_spec(top) if top.isidentifier() else None
        if spec is None and top.isidentifier():
            spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()])  # the workers' sys.path[0]
    except (ImportError, ValueError):  # a module this process holds oddly (no spec): the workers will say
        return
    if spec is not None and not (name.endswith(".py") and spec.submodule_search_locations is None):
        package = _package_dir(name, spec.submodule_search_locations)
        if package is not None and not (package / "__main__.py").exists():
            raise ConfigError(
                f"module {name!r} is a package without a __main__.py: `python -m {name}` has nothing to run\n"
                "hint: name the module that runs inside it (-m package.module), or add a __main__.py to the package"
            )
        return
    if Path(name).is_file() or name.endswith(".py"):
        hint = f"--module takes a module's name: pass {name} without --module (-m)"
        if spec is not None:
            hint += f", or {name.removesuffix('.py')} with it"
        raise ConfigError(f"module {name!r} is a file's name, not a module's\nhint: {hint}")
    names = [found.name for found in pkgutil.iter_modules([os.getcwd(), *sys.path])]
    near = nearest(top, names)
    hint = (
        f"did you mean -m {near}{name.removeprefix(top)}?"
        if near is not None
        else "install the package, or run from the folder it is in; for a script, pass its path without --module (-m)"
    )
    raise ConfigError(f"module {name!r} cannot be found: no {top!r} in {Path.cwd()} or on Python's path\nhint: {hint}")


def _package_dir(name: str, locations: Sequence[str] | None) -> Path | None:
    """The directory of the package ``name`` names, followed on disk from its top-level package's ``locations``
    (nothing imported); None for a module that is a file, or one that cannot be followed (the workers will say)."""
    directories = [Path(where) for where in locations or ()]
    for part in name.split(".")[1:]:
        directories = [where / part for where in directories if (where / part).is_dir()][:1]
    return directories[0] if directories else None


def check_master_addr(config: LaunchConfig) -> None:
    """Refuse a --master-addr of a job on one machine that is not this machine's: this launcher hosts the
    rendezvous, and its workers would look for it there, retrying for torch's store timeout (15 minutes)."""
    host = config.master_addr
    if host is None or config.nnodes > 1 or config.rdzv_endpoint is not None:
        return
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise invalid(
            "master_addr", host, "an address or host name of this machine for --nnodes 1",
            f"{host} cannot be resolved ({exc.strerror or exc}): pass this machine's address, or leave "
            "--master-addr out for a rendezvous on a free port here",
        ) from None  # fmt: skip
    if not any(_binds(family, str(address[0])) for family, _, _, _, address in found):
        raise invalid(
            "master_addr", host, "an address or host name of this machine for --nnodes 1",
            f"{host} is not an address of this machine, where the launcher of a job on one machine hosts the "
            "workers' rendezvous: pass one of its addresses (127.0.0.1 will do), or leave --master-addr out; a job "
            "on several machines takes --nnodes N and --node-rank R as well",
        )  # fmt: skip


def _binds(family: int, address: str) -> bool:
    """Whether a socket can listen at ``address`` (of ``family``): whether the address is this machine's."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError:
        return False
    return True
