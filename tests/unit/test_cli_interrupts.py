"""A Ctrl-C that no step of a command says (one while torch imports, say) is said, not an exit 130 without a word."""

from __future__ import annotations

import functools
import importlib
import signal

import pytest
from typer.testing import CliRunner

import redline.cli.main as cli_main
from redline.cli.main import app, main
from redline.errors import StoppedBySignal, Terminated


def interrupted_import(monkeypatch: pytest.MonkeyPatch, raised: KeyboardInterrupt) -> None:
    """Have the import of a command's module (torch's, where it is a second or more) meet ``raised``."""
    real = importlib.import_module

    def import_module(name: str, package: str | None = None):
        if name.startswith("redline.cli."):
            raise raised
        return real(name, package)

    monkeypatch.setattr(cli_main.importlib, "import_module", import_module)


def test_a_ctrl_c_while_a_command_imports_says_nothing_was_run_and_exits_130(monkeypatch, capsys):
    interrupted_import(monkeypatch, KeyboardInterrupt())
    result = CliRunner().invoke(app, ["train", "--task", "example:digits"])
    assert isinstance(result.exception, StoppedBySignal) and result.exception.exit_code == 130
    assert str(result.exception) == (
        "`redline train` stopped by Ctrl-C while it started (importing its modules, torch's among them for most): "
        "nothing was run"
    )
    monkeypatch.setattr("sys.argv", ["redline", "train", "--task", "example:digits"])
    with pytest.raises(SystemExit) as exited:
        main()  # the console script: the message on stderr, the shell's code for SIGINT
    assert exited.value.code == 128 + signal.SIGINT
    assert "error: `redline train` stopped by Ctrl-C while it started" in capsys.readouterr().err


@pytest.mark.parametrize(("raised", "said", "code"), [(KeyboardInterrupt(), "Ctrl-C", 130),
                                                      (Terminated(signal.SIGTERM), "SIGTERM", 143)])  # fmt: skip
def test_an_interrupt_in_a_part_of_a_run_that_says_nothing_of_it_is_said_with_its_signals_code(
    monkeypatch, tmp_path, raised, said, code
):
    # a SIGTERM is a Terminated inside a command's part that takes it as Ctrl-C (cli/signals.py terminate_as_interrupt)
    import redline.cli.report as report

    @functools.wraps(report.report)
    def interrupted(*args, **kwargs):
        raise raised

    monkeypatch.setattr(report, "report", interrupted)
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert isinstance(result.exception, StoppedBySignal) and result.exception.exit_code == code
    assert str(result.exception) == f"`redline report` stopped by {said} while it ran, before it said it was done"


def test_a_launched_workers_interrupt_is_left_to_its_launcher(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    interrupted_import(monkeypatch, KeyboardInterrupt())
    result = CliRunner().invoke(app, ["train", "--task", "example:digits"])
    assert not isinstance(result.exception, StoppedBySignal) and result.exit_code == 130  # typer's, without a word


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_the_process_was_started_ignoring_stays_ignored_in_a_command(signum):
    from redline.cli.signals import terminate_as_interrupt

    before = signal.signal(signum, signal.SIG_IGN)  # a parent that ignores it (nohup for SIGHUP)
    try:
        with terminate_as_interrupt():
            assert signal.getsignal(signum) is signal.SIG_IGN
        assert signal.getsignal(signum) is signal.SIG_IGN
        signal.signal(signum, signal.SIG_DFL)
        with terminate_as_interrupt(), pytest.raises(Terminated):  # one left at its default is taken as an interrupt
            signal.raise_signal(signum)
        assert signal.getsignal(signum) is signal.SIG_DFL
    finally:
        signal.signal(signum, before)
