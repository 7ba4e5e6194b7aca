"""Fixtures the CPU tier's tests share."""

import gc
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from redline.cli import main as cli_main
from redline.render.log import LOGGER
from redline.runtime import measure
from redline.runtime.trial import Measured


@dataclass
class Ran:
    """What a `redline` command did: its exit code and what it printed (as subprocess.CompletedProcess names them)."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def redline_here(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., Ran]]:
    """Run `redline ARGS` in this process through the console script's own ``main()``: exit code, stdout, stderr.

    A command in a process of its own pays torch's import first (3-6 s here), which most tests of a command's
    words need not: they run it here, ``env`` set for that call alone. The tests of what only a process shows
    (signals, the console script found on PATH, exit at interpreter shutdown) still start one.
    """
    logger = logging.getLogger(LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)  # main() sets them up as for a process

    def run(*args: str, env: dict[str, str] | None = None) -> Ran:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            patch.setattr(sys, "argv", ["redline", *args])
            patch.setattr(cli_main, "_leave", lambda done: None)  # a run in this process never ends it
            capsys.readouterr()
            try:
                cli_main.main()
                code = 0
            except SystemExit as exc:  # typer ends every command with one, as the process would exit
                code = cli_main.exit_status(exc)
            out, err = capsys.readouterr()
        return Ran(code, out, err)

    yield run
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of one rank, for the wrapping and collectives of a distributed run in one process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # FSDP modules sit in reference cycles; free them while gloo still runs
        dist.destroy_process_group()


@pytest.fixture
def bf16_measured_faster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Plan as on an AMX CPU, with an empty trial cache, and fake the precision trial: bf16 steps in 0.7 of fp32's
    time. Returns the candidates of each trial run, so a test sees whether one ran."""
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("REDLINE_CPU", "amx")
    calls: list[list[str]] = []

    def fake_trial(model, optimizer, loss_fn, batch, device, candidates, **_):
        calls.append(list(candidates))
        return [Measured(name, (ms / 1e3,) * 12, (2.0, 1.8)) for name, ms in (("fp32", 10.0), ("bf16-mixed", 7.0))]

    monkeypatch.setattr(measure, "run_trial", fake_trial)
    return calls


@pytest.fixture
def broken_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile whose backend fails on every graph (as a broken C++ compiler would), on a device where the Runtime
    takes it as able to compile: the Runtime then falls back to eager, with torch's reason."""
    import torch

    def broken_backend(graph_module: object, example_inputs: object) -> object:
        raise RuntimeError("backend exploded (made up by the test)")

    real = torch.compile
    monkeypatch.setattr("torch.compile", lambda fn, **options: real(fn, backend=broken_backend, **options))
    monkeypatch.setattr("redline.runtime.compile.compile_supported", lambda device_type: (True, ""))
