"""The `redline` command: one thin module per subcommand, each parsing, calling the library, rendering.

A subcommand's module is imported only when that subcommand runs: `redline train` needs torch,
`redline doctor` must run where `import torch` fails, and `redline --help` needs neither. The
group keeps each subcommand's one-line summary, so the help lists them without importing them.
"""

from __future__ import annotations

import difflib
import gc
import importlib
import logging
import os
import re
import signal
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from redline.errors import (
    ConfigError,
    RedlineError,
    StoppedBySignal,
    first_to_say,
    interrupting_signal,
    invalid,
    mark_peer_stopped,
    traceback_asked,
)
from redline.hardware.contention import contention_off
from redline.render.console import results_apart
from redline.render.log import show_logs


@dataclass(frozen=True)
class Subcommand:
    """Where a subcommand's function lives, and what `redline --help` says of it."""

    module: str
    function: str
    summary: str  # the first line of the function's docstring; a test keeps the two equal
    context_settings: dict[str, Any] = field(default_factory=dict)


SUBCOMMANDS = {
    "train": Subcommand(
        "redline.cli.train", "train", "Train a Task with every automatic choice explained, and print the summary."
    ),
    "bench": Subcommand(
        "redline.cli.bench",
        "bench",
        "Time the naive loop, a matrix of settings and auto side by side, and report speed-ups and MFU.",
    ),
    "tune": Subcommand(
        "redline.cli.tune",
        "tune_command",
        "Search for the fastest settings of a Task within a budget, and cache them for --plan tuned.",
    ),
    "profile": Subcommand(
        "redline.cli.profile",
        "profile_command",
        "Profile a Task's training steps: each phase's time, the heaviest operators, and what to try.",
    ),
    "memory": Subcommand(
        "redline.cli.memory",
        "memory",
        "Estimate a Task's training-step memory, whether it fits a GPU, and the largest batch predicted to fit.",
    ),
    "doctor": Subcommand(
        "redline.cli.doctor",
        "doctor",
        "Check this machine for GPU deep learning, measure its devices, and give the fix for each problem.",
    ),
    "report": Subcommand(
        "redline.cli.report",
        "report",
        "Write a training run's HTML report: its loss, throughput and memory charts, summary and Plan.",
    ),
    "launch": Subcommand(
        "redline.cli.launch",
        "launch_command",
        "Run SCRIPT [ARGS...] on N processes (and N machines) with torch.distributed.",
        # Every argument after SCRIPT is the script's, as with python and torchrun: its own -m or --nproc included.
        {"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
    ),
    "loadtest": Subcommand(
        "redline.cli.loadtest",
        "loadtest_command",
        "Load a URL at a fixed rate (open loop) or concurrency, and report latency percentiles and statuses.",
    ),
    "predict": Subcommand(
        "redline.cli.predict",
        "predict",
        "Run a model over a .npy file of samples and write its outputs to another .npy file.",
    ),
    "serve": Subcommand(
        "redline.cli.serve",
        "serve_command",
        "Serve a model over HTTP with dynamic batching, bounded queueing and Prometheus metrics.",
    ),
}


# Help as click writes it: rich's option table cuts long flag names (`--early-stopping-pat…`) to fit
# 80 columns, where click's list keeps each name whole and wraps the text beside it.
HELP_MARKUP = None


# What a number flag takes, said as every refusal says what is allowed.
_NUMBER_WORDS = {int: "an integer", float: "a number"}
# An empty path flag (refused by cli.options.given_path): typed so, it would name the current directory.
_EMPTY_PATH = (
    "a path, not an empty one",
    "name the file or folder; an empty value is often a shell variable that is not set",
)


def unparsed(error: typer.BadParameter) -> ConfigError | None:
    """Say the parser's refusal of a flag's value (``--epochs ten``, ``--out ""``) as every refusal is said: the flag,
    the value as typed, what the flag takes, and the fix; None for any other (a missing option), in the parser's words.

    The parser (typer, through pydantic) keeps the value it could not read in the error's cause.
    """
    param, cause = error.param, error.__cause__
    problems = cause.errors() if cause is not None and hasattr(cause, "errors") else []
    kind = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if param is None or kind not in (*_NUMBER_WORDS, Path) or not problems or "input" not in problems[0]:
        return None
    flag, value = max(param.opts, key=len), problems[0]["input"]
    refused = problems[0].get("ctx", {}).get("error")  # the parser's own error, as pydantic keeps it
    if isinstance(refused, ConfigError) and refused.parts:  # a parser's refusal (cli.options.given_file's)
        return invalid(flag, value, *refused.parts[2:])
    if kind is Path:
        return invalid(flag, value, *_EMPTY_PATH)
    example = param.default if type(param.default) is kind else 1
    return invalid(flag, value, _NUMBER_WORDS[kind], f"e.g. {flag} {example}")


# The parser's usage errors: click's, or the copy of click newer typers carry (typer._click), whichever typer runs.
_USAGE_ERROR: type[Exception] = next(kind for kind in typer.BadParameter.__mro__ if kind.__name__ == "UsageError")


def unknown_flag(flag: str, command: Any, name: str) -> ConfigError:
    """Say a flag the command does not have as every refusal is said, with its nearest flags as the fix (the
    parser's own guess named any flag sharing a letter: ``--bogus``, "Possible options: --out").

    ``name`` is the subcommand's, or empty for redline's own flags (``redline --verison``).
    """
    called = f"redline {name}" if name else "redline"
    listed = f"`{called} --help` lists its flags" if name else "`redline --help` lists its flags and commands"
    turned_off = _turned_off(flag, command)
    if turned_off:
        return ConfigError(f"{flag} is not a flag of `{called}`\nhint: {turned_off} ({listed})")
    names = [opt for param in command.params for opt in (*param.opts, *param.secondary_opts)]  # --no-progress too
    flags = {opt.lstrip("-"): opt for opt in names if opt.startswith("--")}
    word = flag.lstrip("-")
    # a field's name for its prefixed flag (--patience, --early-stopping-patience), then the near spellings,
    # compared without their dashes, which every flag shares: "--bogus" is then near no flag, not "--out"
    ending = [opt for key, opt in sorted(flags.items()) if key.endswith(f"-{word}")]
    near = [flags[key] for key in difflib.get_close_matches(word, sorted(flags), n=3, cutoff=0.6)]
    nearest = list(dict.fromkeys([*ending, *near]))[:3]
    hint = f"did you mean {' or '.join(nearest)}? ({listed})" if nearest else listed
    return ConfigError(f"{flag} is not a flag of `{called}`\nhint: {hint}")


def _turned_off(flag: str, command: Any) -> str:
    """How to have off what ``--no-X`` asks off where ``--X`` has no such side: ``--X off`` for a flag taking off,
    else leaving ``--X`` out (its nearest spelling, ``--X`` itself, would turn on what was asked off); "" where
    the command has no ``--X``."""
    if not flag.startswith("--no-"):
        return ""
    positive = "--" + flag.removeprefix("--no-")
    param = next((param for param in command.params if positive in param.opts), None)
    if param is None:
        return ""
    if getattr(param, "is_flag", False):
        return f"{positive} is a switch, off unless given: leave it out"
    takes = f"{param.metavar or ''} {param.help or ''}"
    if re.search(r"\boff\b", takes):
        return f"did you mean {positive} off?"
    return f"{positive} takes a value: leave it out for its default"


def unknown_command(name: str) -> ConfigError:
    """Say a command redline does not have as every refusal is said, with the nearest commands as the fix."""
    nearest = [f"`redline {near}`" for near in difflib.get_close_matches(name, sorted(SUBCOMMANDS), n=3, cutoff=0.6)]
    if name in ("help", "version"):  # the flags of git's and pip's commands of these names
        nearest = ["`redline --help` (and `redline COMMAND --help`)" if name == "help" else "`redline --version`"]
    listed = f"its commands are {', '.join(SUBCOMMANDS)}"
    hint = f"did you mean {' or '.join(nearest)}? ({listed})" if nearest else listed
    return ConfigError(f"{name} is not a command of `redline`\nhint: {hint}")


def refused_usage(error: Exception, command: Any, name: str) -> ConfigError | None:
    """A flag the command lacks (the parser's NoSuchOption) said as every refusal is; None for other usage errors."""
    flag = getattr(error, "option_name", None)
    if type(error).__name__ != "NoSuchOption" or not isinstance(flag, str):
        return None
    return unknown_flag(flag, command, name)


# The packages of redline's extras (pyproject.toml), by the extra that installs each.
EXTRAS = {
    **dict.fromkeys(("starlette", "uvicorn", "prometheus_client", "orjson", "aiohttp"), "serve"),
    "matplotlib": "report",
    "tensorboard": "tensorboard",
}


def interrupted(command: LazyCommand, exc: KeyboardInterrupt) -> StoppedBySignal:
    """A Ctrl-C that no step of ``command`` said: one while it started (torch's import, a second or more, before
    anything ran), or in a part of its run that tells no outcome of its own; or a SIGTERM such a part took as one
    (cli/signals.py: outside those parts, SIGTERM still ends the process as Python leaves it to)."""
    signum = interrupting_signal(exc)
    said = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    if not command.parsed:
        told = "while it started (importing its modules, torch's among them for most): nothing was run"
    else:
        told = "while it ran, before it said it was done"
    return StoppedBySignal(signum, f"`redline {command.name}` stopped by {said} {told}")


class LazyCommand(TyperCommand):
    """A subcommand known by its name and summary until it runs; then its module is imported."""

    def __init__(self, name: str, spec: Subcommand) -> None:
        super().__init__(name=name, short_help=spec.summary)
        self.spec = spec
        self.parsed = False  # its module imported and its arguments read: it runs from here

    def load(self) -> Any:
        """Import the subcommand's module and return its command, as typer builds it."""
        try:
            module = importlib.import_module(self.spec.module)
        except ImportError as exc:  # an extra not installed; else torch (or a library it loads) is broken
            missing = (getattr(exc, "name", None) or "").split(".")[0]
            if missing in EXTRAS:
                raise RedlineError(
                    f"`redline {self.name}` needs {missing}, of redline's {EXTRAS[missing]!r} extra, which is not "
                    f"installed\nhint: pip install 'redline[{EXTRAS[missing]}]'"
                ) from exc
            raise RedlineError(
                f"`redline {self.name}` could not start: {type(exc).__name__}: {exc}\n"
                "hint: run `redline doctor`: it checks torch and its CUDA libraries and gives the fix"
            ) from exc
        single = typer.Typer(add_completion=False, rich_markup_mode=HELP_MARKUP)
        single.command(self.name, context_settings=self.spec.context_settings)(getattr(module, self.spec.function))
        return typer.main.get_command(single)

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        # The group invokes the command of the context made here: the real one, loaded now.
        command = self.load()
        try:
            made = command.make_context(info_name, args, parent=parent, **extra)
            self.parsed = True
            return made
        except typer.BadParameter as error:  # a value the parser cannot read (--epochs ten): said as any refusal
            raise unparsed(error) or error from None
        except _USAGE_ERROR as error:  # a misspelt flag: said as any refusal, with the nearest flags
            refused = refused_usage(error, command, info_name or self.name or "")
            if refused is None:
                raise
            raise refused from None


class LazyGroup(TyperGroup):
    """The root group: every entry of SUBCOMMANDS, each loaded when it runs."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for name, spec in SUBCOMMANDS.items():
            self.add_command(LazyCommand(name, spec))

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:  # typer would exit 130 without a word
            command = self.commands.get(ctx.invoked_subcommand or "")
            if not isinstance(command, LazyCommand) or ("RANK" in os.environ and "MASTER_ADDR" in os.environ):
                raise  # a launched worker's (parallel/env.py is_launched): its launcher says it, once for the job
            raise interrupted(command, exc) from None

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except _USAGE_ERROR as error:  # redline's own flags (--version alone): a misspelt one as any refusal
            refused = refused_usage(error, self, "")
            if refused is None:
                raise
            raise refused from None

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        # A command redline lacks (`redline trian`), said as any refusal with the nearest commands; the parser
        # said it in its usage message, unlike every other refusal.
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in SUBCOMMANDS:
            raise unknown_command(name)
        return super().resolve_command(ctx, args)


app = typer.Typer(
    name="redline",
    cls=LazyGroup,
    help="Run plain PyTorch training and inference as fast as the hardware allows, and say why.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=HELP_MARKUP,
)


def version_line() -> str:
    """redline's version with the torch and Python it runs on, read without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    from redline.version import __version__

    try:
        torch = f"torch {version('torch')}"
    except PackageNotFoundError:
        torch = "torch not installed"
    return f"redline {__version__} ({torch}, Python {sys.version.split()[0]})"


def _print_version(asked: bool) -> None:
    if asked:
        print(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
) -> None:
    """Run plain PyTorch training and inference as fast as the hardware allows, and say why."""
    contention_off()  # a mistyped REDLINE_CONTENTION is refused at once, not at the first timing, minutes in


def main() -> None:
    """Entry point of the console script: a RedlineError becomes one clear message and its exit code (2).

    With REDLINE_TRACEBACK=1 the traceback behind the message is printed first (for a TrainingError,
    the one from the user's own model or loss).
    """
    show_logs()
    try:
        _run()
    except SystemExit as done:
        _leave(done)
        raise


def _run() -> None:
    try:
        with results_apart("--json" in sys.argv[1:]):  # the JSON alone on stdout, whatever the task prints
            app()
    except RedlineError as exc:
        status = _say(exc)
    else:
        return
    # Exited outside the handler, so that nothing holds the error once it is said: its frames hold what the
    # command had built, a launched worker's DDP model among them, whose reducer keeps the process group
    # alive past its leaving; gloo's threads then outlived the interpreter and aborted it at exit
    # (SIGABRT, "terminate called without an active exception", where the exit status was 2).
    gc.collect()  # frames in a cycle with the error go now, not at the interpreter's exit
    sys.exit(status)


def _say(exc: RedlineError) -> int:
    """Print ``exc`` (once among the launched workers that met it alike); return the exit status it asks for."""
    mark_peer_stopped(str(exc))
    if not first_to_say(str(exc)):  # under the launcher, the workers that failed alike print it once
        return exc.exit_code
    if traceback_asked():  # the cause's traceback: the message follows
        if exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        else:
            traceback.print_tb(exc.__traceback__, file=sys.stderr)
    print(f"error: {exc}", file=sys.stderr)
    return exc.exit_code


def _leave(done: SystemExit) -> None:
    """Exit now by ``os._exit`` when a served model was left in a call (a batch whose requests all timed out).

    The interpreter's shutdown would abort the process as soon as that call's next torch operation returns
    (see ``redline.serve.dispatch.ModelThread``): what was written is flushed, and the exit status kept.
    """
    dispatch = sys.modules.get("redline.serve.dispatch")  # not imported: no model was served
    if dispatch is None or not dispatch.calls_left_running():
        return
    status = exit_status(done)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def exit_status(done: SystemExit) -> int:
    """The status a process ends with on ``done``, as Python has it: a message is printed to stderr, status 1."""
    if done.code is not None and not isinstance(done.code, int):
        print(done.code, file=sys.stderr)
    return done.code if isinstance(done.code, int) else int(done.code is not None)
