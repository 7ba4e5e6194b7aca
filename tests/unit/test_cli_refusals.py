"""The command line's refusals: each is said as `--flag=value is not allowed; expected ...` with a hint, exit 2."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import redline
from redline.cli.main import app
from redline.errors import ConfigError

# What each command needs besides the flag under test; none of it is reached, as the value is refused first.
WHERE = {
    "serve": ["example:digits"], "loadtest": ["http://127.0.0.1:9/"], "predict": ["example:digits"],
    "launch": ["train.py"],  # the script comes last: every argument after it is its own
    "doctor": [], "report": ["runs/x"],
}  # fmt: skip


def refusal(*args: str) -> str:
    """The message of the ConfigError the command refuses ``args`` with (main() prints it and exits 2)."""
    result = CliRunner().invoke(app, [*args, *WHERE.get(args[0], ["--task", "example:digits"])])
    assert isinstance(result.exception, ConfigError), result.output
    return str(result.exception)


@pytest.mark.parametrize(
    ("args", "expected", "hint"),
    [
        (["train", "--epochs", "ten"], "an integer", "e.g. --epochs 1"),
        (["train", "--batch-size", "1.5"], "an integer", "e.g. --batch-size 1"),
        (["train", "--clip-grad-norm", "abc"], "a number", "e.g. --clip-grad-norm 1"),
        (["bench", "--steps", "x"], "an integer", "e.g. --steps 60"),
        (["serve", "--port", "http"], "an integer", "e.g. --port 8000"),
        (["loadtest", "--rate", "fast"], "a number", "e.g. --rate 1"),
        (["memory", "--mem-gib", "lots"], "a number", "e.g. --mem-gib 1"),
        (["predict", "--batch-size", ""], "an integer", "e.g. --batch-size 32"),
    ],
)
def test_a_value_the_parser_cannot_read_is_refused_by_its_flag_with_an_example(args, expected, hint):
    flag, value = args[1], args[2]
    assert refusal(*args) == f"{flag}={value!r} is not allowed; expected {expected}\nhint: {hint}"


def test_a_missing_option_is_still_the_parsers_usage_error():
    result = CliRunner().invoke(app, ["train"])
    assert result.exit_code == 2 and "Missing option '--task'" in result.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["train", "--max-step", "3"], "--max-step is not a flag of `redline train`\nhint: did you mean "
                                       "--max-steps or --max-restarts? (`redline train --help` lists its flags)"),
        # a switch's off side is among the flags: told --progress, the user who wanted it off would turn it on
        (["train", "--no-progres"], "--no-progres is not a flag of `redline train`\nhint: did you mean "
                                    "--no-progress or --progress? (`redline train --help` lists its flags)"),
        (["doctor", "--quik"], "--quik is not a flag of `redline doctor`\nhint: did you mean --quick? "
                               "(`redline doctor --help` lists its flags)"),
        # near no flag: no guess (the parser's own named --out, which shares a letter with it)
        (["train", "--bogus"], "--bogus is not a flag of `redline train`\n"
                               "hint: `redline train --help` lists its flags"),
    ],
)  # fmt: skip
def test_a_flag_the_command_lacks_is_refused_with_the_nearest_flags(args, said):
    assert refusal(*args) == said


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        # the nearest spelling of each, the flag without its no-, would turn on what was asked off
        (["train", "--no-json"], "--json is a switch, off unless given: leave it out"),
        (["train", "--no-compile"], "did you mean --compile off?"),
        (["train", "--no-trial"], "did you mean --trial off?"),
        (["serve", "--no-cuda-graphs"], "did you mean --cuda-graphs off?"),
        (["train", "--no-out"], "--out takes a value: leave it out for its default"),
        # a field's name, as the README lists EarlyStopping's, finds its prefixed flag
        (["train", "--patience", "3"], "did you mean --early-stopping-patience?"),
        (["train", "--monitor", "val_loss"], "did you mean --early-stopping-monitor?"),
    ],
)  # fmt: skip
def test_a_flag_asked_off_or_by_its_fields_name_is_told_the_flag_that_does_it(args, hint):
    said = refusal(*args)
    assert said.startswith(f"{args[1]} is not a flag of `redline {args[0]}`\nhint: {hint} (`redline {args[0]} --help`")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["trian"], "trian is not a command of `redline`\nhint: did you mean `redline train`? (its commands are "
                    "train, bench, tune, profile, memory, doctor, report, launch, loadtest, predict, serve)"),
        (["--verison"], "--verison is not a flag of `redline`\nhint: did you mean --version? (`redline --help` "
                        "lists its flags and commands)"),
        (["--bogus", "train"], "--bogus is not a flag of `redline`\nhint: `redline --help` lists its flags and "
                               "commands"),
        (["help", "train"], "help is not a command of `redline`\nhint: did you mean `redline --help` (and `redline "
                            "COMMAND --help`)? (its commands are train, bench, tune, profile, memory, doctor, report, "
                            "launch, loadtest, predict, serve)"),
    ],
)  # fmt: skip
def test_a_command_or_flag_redline_lacks_is_refused_with_the_nearest(args, said):
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception) == said


def test_a_command_near_no_command_is_refused_with_the_list_of_commands():
    result = CliRunner().invoke(app, ["frobnicate", "--task", "x"])
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception).startswith("frobnicate is not a command of `redline`\nhint: its commands are train")


def test_the_console_prints_a_value_refusal_as_one_error_line_and_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "redline", "serve", "example:digits", "--port", "http"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == "error: --port='http' is not allowed; expected an integer\nhint: e.g. --port 8000\n"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["train", "--loader-workers", "-1"], "--loader-workers=-1 is not allowed; expected a whole number of "
                                              "worker processes (0 or more)\n"
                                              "hint: leave --loader-workers out for its default"),
    ],
)  # fmt: skip
def test_an_options_refusal_without_a_hint_is_given_the_flags_default_as_one(args, said):
    assert refusal(*args) == said


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["train", "--precision", "bf16"], "did you mean --precision 'bf16-mixed'?"),
        (["profile", "--precision", "fp32,bf16-mixed"], "one value here, not a list: give 'fp32', then 'bf16-mixed' "
                                                        "in another run (redline bench times several side by side)"),
        (["train", "--nproc", "two"], "--nproc N starts N workers on this machine; --nproc 'auto' one per GPU (one "
                                      "in all without a GPU)"),
        (["launch", "--node-rank", "3"], "number the machines from 0: --node-rank 0 on the one whose address the "
                                         "others are given"),
        (["loadtest", "--method", ""], "e.g. --method 'POST'"),
    ],
)  # fmt: skip
def test_an_options_refusal_with_a_hint_keeps_its_own_said_by_flags(args, hint):
    assert refusal(*args).endswith(f"\nhint: {hint}")


def test_predict_refuses_an_input_of_no_samples_with_the_fix(tmp_path):
    np.save(tmp_path / "empty.npy", np.zeros((0, 1, 8, 8), dtype=np.float32))
    args = ["predict", "--input", str(tmp_path / "empty.npy"), "--output", str(tmp_path / "out.npy")]
    message = refusal(*args)
    assert message.startswith(f"--input {str(tmp_path / 'empty.npy')!r} holds no samples (shape (0, 1, 8, 8))\n")
    assert message.endswith("\nhint: save at least one sample along the first dimension: numpy.save(path, array)")
    assert not (tmp_path / "out.npy").exists()


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The workers `redline train --nproc` would start, recorded instead, in an environment of no launcher."""
    import redline.cli.train as train_cli

    started: list[list[str]] = []
    monkeypatch.setattr(train_cli, "check_given_task", lambda *args, **kwargs: None)
    monkeypatch.setattr(train_cli, "launch", lambda config, target, module: started.append(list(target)))
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return started


def test_a_stray_rank_is_refused_with_nproc_naming_the_variables_to_unset(launches, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    message = refusal("train", "--nproc", "2")
    assert message.startswith("--nproc starts the worker processes, but RANK=0 is set in the environment")
    assert message.endswith("\nhint: unset RANK WORLD_SIZE and run the command again")
    assert launches == []


def test_nproc_starts_the_workers_when_no_rank_is_set(launches):
    result = CliRunner().invoke(app, ["train", "--task", "example:digits", "--nproc", "2"])
    assert result.exit_code == 0, result.output
    assert len(launches) == 1 and launches[0][0] == "redline"  # the workers run `python -m redline` less --nproc


def test_a_worker_of_a_launcher_runs_as_that_worker_whatever_nproc_says(launches, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["train", "--task", "no/such/file.py:task", "--nproc", "2"])
    assert "no/such/file.py" in str(result.exception)  # it went on to load the task itself, as a worker does
    assert launches == []


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--out", ""],  # was the current directory: the run's files went there
        ["train", "--out="],
        ["loadtest", "--payload", ""],
        ["serve", "--weights", ""],
        ["predict", "--input", "", "--output", "out.npy"],
        ["bench", "--html", ""],
        ["profile", "--trace", ""],
        ["doctor", "--save-probe", ""],
    ],
)
def test_an_empty_path_is_refused_by_its_flag_not_read_as_the_current_directory(args):
    flag = args[1].removesuffix("=")
    assert refusal(*args) == (
        f"{flag}='' is not allowed; expected a path, not an empty one\n"
        "hint: name the file or folder; an empty value is often a shell variable that is not set"
    )


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["profile", "--trace", "traces/"], "traces/trace.json.gz"),  # was traces/out, which --trace refuses again
        (["bench", "--html", "pages/"], "pages/bench.html"),
        (["report", "--html", "pages/"], "pages/report.html"),
        (["doctor", "--save-probe", "probes/"], "probes/probe.json"),
        (["predict", "--input", "x.npy", "--output", "outs/"], "outs/outputs.npy"),
    ],
)
def test_a_file_flag_given_a_directory_names_a_file_the_flag_takes_in_it(args, named):
    flag, value = args[-2:]
    assert refusal(*args) == (
        f"{flag}={value!r} is not allowed; expected a file, not a directory (it ends with /)\n"
        f"hint: name a file in it, e.g. {named}"
    )


def test_an_empty_resume_is_refused_not_read_as_the_current_directory():
    assert refusal("train", "--resume=", "--out", "run") == (
        "--resume='' is not allowed; expected 'auto' or a checkpoint's path, not an empty one\n"
        "hint: name it; an empty value is often a shell variable that is not set"
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["bench", "--html=~/figures/bench.html"], "--html"),
        (["profile", "--trace=~/traces/t.json"], "--trace"),
        (["predict", "--input", "~/samples.npy", "--output", "~/out.npy"], "--input"),
    ],
)
def test_a_path_flag_starting_with_a_tilde_is_under_home_as_the_shell_would_make_it(tmp_path, monkeypatch, args, said):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # where a ~ not expanded would make a directory of that name
    (tmp_path / "figures").touch()  # a file where the report's directory would be: refused, naming the path read
    (tmp_path / "traces").touch()
    result = CliRunner().invoke(app, [*args, *WHERE.get(args[0], ["--task", "example:digits"])])
    first = str(result.exception).splitlines()[0]
    assert first.startswith(said) and str(tmp_path) in first and "~" not in first, result.output


def test_a_batch_the_workers_cannot_split_is_refused_before_they_start(monkeypatch):
    from redline.cli import train as train_cli

    monkeypatch.setattr(train_cli, "launch", lambda *args, **kwargs: pytest.fail("the workers were started"))
    assert refusal("train", "--nproc", "2", "--batch-size", "15") == (
        "--batch-size=15 is not allowed; expected a multiple of 2: the batch size is the global batch, split across 2 "
        "processes\nhint: e.g. --batch-size 16"
    )


def test_a_tasks_own_batch_the_workers_cannot_split_is_named_as_the_tasks_not_as_a_flag(monkeypatch):
    """`--task-arg batch_size=33 --nproc 2`: each worker said `--batch-size=33 is not allowed`, a flag never passed."""
    from redline.train.config import TrainerConfig

    monkeypatch.setenv("WORLD_SIZE", "2")  # a launched worker's: the launcher runs no task, so the worker checks
    monkeypatch.setenv("RANK", "1")
    task = redline.load_task("example:digits")
    odd = dataclasses.replace(task, batch_size=33)
    with pytest.raises(ConfigError) as refused:
        TrainerConfig().check_task(odd)
    assert str(refused.value) == (
        "task 'digits''s own batch_size=33 is not allowed under 2 processes; expected a multiple of 2: the batch size "
        "is the global batch, split across 2 processes\nhint: pass --batch-size 34 (batch_size=34), or the task's own "
        "option for it"
    )
    TrainerConfig(batch_size=34).check_task(odd)  # one given: the workers' split checks the option, named as such
    TrainerConfig().check_task(dataclasses.replace(task, batch_size=32))


def test_tune_refuses_a_budget_of_nothing_before_the_task_loads():
    """Before, the task loaded first: a factory reading a dataset for minutes, then the refusal."""
    result = CliRunner().invoke(app, ["tune", "--task", "no_such_module_here:task", "--budget", "0"])
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception) == "--budget=0.0 is not allowed; expected a number > 0\nhint: e.g. --budget 1.0"


def test_an_error_under_a_progress_bar_in_a_pipe_is_the_first_line_not_after_a_blank_one():
    """A bar that ended was a blank line in a file or pipe, before the error of a run it was drawn for."""
    result = subprocess.run(
        [sys.executable, "-m", "redline", "bench", "--task", "example:digits", "--devices", "cuda:99"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and result.stderr.startswith("error: "), result.stderr


def test_tunes_steps_say_their_own_least_once():
    shown = " ".join(CliRunner().invoke(app, ["tune", "--help"], terminal_width=200).output.split())
    assert "Timed steps per candidate, rounded up to whole windows of 5, and 10 at least. [default: 30]" in shown


def test_bench_refuses_a_page_over_a_file_that_is_no_page_of_redlines_and_keeps_it(tmp_path):
    """Before, `bench --html RUN/checkpoints/step-5/model.safetensors` replaced the weights with the page."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    result = CliRunner().invoke(app, ["bench", "--task", "example:digits", "--html", str(weights)])
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception).startswith(f"--html {str(weights)!r} is a file that is no page (not .html)")
    assert weights.read_bytes() == b"weights"
    mine = tmp_path / "mine.html"  # a page written by hand: refused before the bench runs, not replaced after it
    mine.write_text("<p>my notes</p>")
    result = CliRunner().invoke(app, ["bench", "--task", "example:digits", "--html", str(mine)])
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception).startswith(f"--html {str(mine)!r} is a page redline did not make")
    assert mine.read_text() == "<p>my notes</p>"
