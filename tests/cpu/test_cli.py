"""`redline train` from the command line: JSON on stdout, files on disk, clear errors."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import typer
from safetensors.torch import load_file

from redline.cli.main import app
from redline.cli.train import stopped_early
from redline.errors import ConfigError, TrainingError
from redline.runtime.options import RuntimeOptions
from redline.task import load_task
from redline.train.trainer import Trainer


def redline_cli(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "redline", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def plan_table(stdout: str) -> dict[str, tuple[str, str]]:
    """Read the printed Plan back as ``{axis: (value, why)}``, joining the lines rich wrapped."""
    cells: dict[str, tuple[list[str], list[str]]] = {}
    body = stdout.split("┩", 1)[1].split("└", 1)[0]  # the Plan comes first; its rows end at the bottom rule
    for line in body.strip().splitlines():
        axis, value, why = (cell.strip() for cell in line.strip().strip("│").split("│"))
        if axis:  # a new row; an empty axis cell continues the row above
            cells[axis] = ([], [])
        last = cells[next(reversed(cells))]
        last[0].append(value)
        last[1].append(why)
    return {axis: (" ".join(filter(None, value)), " ".join(filter(None, why))) for axis, (value, why) in cells.items()}


CPU_AXES = ["device", "precision", "tf32", "deterministic", "seed", "grad_accum", "micro_batch", "clip_grad_norm",
            "strategy", "channels_last", "compile", "cuda_graphs", "attention", "activation_checkpointing", "optimizer",
            "zero_grad", "loader"]  # fmt: skip


def test_train_json_and_out_dir(tmp_path, redline_here):
    out = tmp_path / "run"
    result = redline_here(
        "train", "--task", "example:digits", "--max-steps", "6", "--seed", "0", "--json", "--out", str(out)
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)  # stdout holds the JSON alone; progress went to stderr
    assert {"plan", "final_loss", "val_metric", "samples_per_s", "device"} <= set(summary)
    assert summary["steps"] == 6 and summary["device"] == "cpu"
    assert summary["plan"]["precision"] == {"value": "fp32", "reason": summary["plan"]["precision"]["reason"]}
    assert summary["plan"]["compile"]["value"] is False
    assert 0.0 <= summary["val_metric"] <= 1.0 and summary["samples_per_s"] > 0
    assert "step 6/6" in result.stderr
    assert json.loads((out / "summary.json").read_text()) == summary
    weights = load_file(out / "model.safetensors")
    expected = load_task("example:digits").build_model().state_dict()
    assert set(weights) == set(expected)
    assert not any(name.startswith(("_orig_mod.", "module.")) for name in weights)


def test_train_prints_the_plan_table(redline_here):
    result = redline_here("train", "--task", "example:digits", "--max-steps", "2", "--task-arg", "width=8")
    assert result.returncode == 0, result.stderr
    plan = plan_table(result.stdout)
    assert list(plan) == CPU_AXES
    assert all(why for _, why in plan.values())
    assert plan["device"][0] == "cpu" and plan["precision"][0] == "fp32" and plan["compile"][0] == "off"
    for text in ("samples/s", "val metric"):
        assert text in result.stdout


# The phrase each faked CPU's precision row must show (tests/unit/test_plan.py checks every wording).
FAKE_CPUS = {"avx2": "AVX2 only", "avx512": "CPU has AVX-512", "amx": "CPU has AMX", "arm": "Arm CPU"}


@pytest.mark.parametrize("isa", FAKE_CPUS)
def test_redline_cpu_makes_the_plan_as_on_that_cpu(isa, redline_here):
    # 200 columns, as a file or pipe gets outside pytest-xdist (whose workers set COLUMNS=80)
    result = redline_here(
        "train", "--task", "example:digits", "--max-steps", "1", env={"REDLINE_CPU": isa, "COLUMNS": "200"}
    )
    assert result.returncode == 0, result.stderr
    value, why = plan_table(result.stdout)["precision"]
    assert value == "fp32"
    assert FAKE_CPUS[isa] in why and f"REDLINE_CPU={isa}" in why
    assert not any(phrase in why for other, phrase in FAKE_CPUS.items() if other != isa)


def test_unknown_redline_cpu_is_one_clear_line(redline_here):
    result = redline_here("train", "--task", "example:digits", "--max-steps", "1", env={"REDLINE_CPU": "avx3"})
    assert result.returncode == 2
    assert "REDLINE_CPU='avx3'" in result.stderr and "'amx'" in result.stderr and "hint:" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_task_spec_is_one_clear_line(redline_here):
    result = redline_here("train", "--task", "example:nope", "--max-steps", "1")
    assert result.returncode == 2
    assert "no built-in example 'nope'" in result.stderr
    assert "Traceback" not in result.stderr


def test_unavailable_device_exits_with_the_fix(redline_here):
    result = redline_here("train", "--task", "example:digits", "--devices", "cuda", "--max-steps", "1")
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "hint:" in result.stderr


def test_out_dir_that_is_a_file_is_refused(tmp_path, redline_here):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = redline_here("train", "--task", "example:digits", "--max-steps", "1", "--out", str(blocker))
    assert result.returncode == 2 and f"--out={str(blocker)!r} is not allowed" in result.stderr
    assert "it is a file" in result.stderr and "hint: e.g. --out runs/NAME" in result.stderr


def test_a_checkpoints_folder_the_run_could_not_write_is_refused_before_it_trains(tmp_path, redline_here):
    """Before, the run trained its steps and failed at its first checkpoint, which lost them."""
    (tmp_path / "checkpoints").write_text("")  # where the run's checkpoints folder would be
    result = redline_here("train", "--task", "example:digits", "--max-steps", "3", "--out", str(tmp_path))
    assert result.returncode == 2 and "the checkpoints/ an earlier run left in it is a file" in result.stderr
    assert f"hint: make {tmp_path / 'checkpoints'} a writable directory" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before the first step


FLAG_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.task import Task


def make(flag: bool = True, name: str = "tiny"):
    if flag:
        raise RuntimeError(f"flag was {flag!r}, name {name!r}")
    return Task(model=nn.Linear(2, 1), loss_fn=nn.functional.mse_loss, name=name,
                train_data=TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4)
"""


NAN_VAL_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from redline.task import Task


def val_loss_nan(outputs, targets):  # finite in training; NaN in evaluation (run without gradients)
    loss = nn.functional.mse_loss(outputs, targets)
    return loss if torch.is_grad_enabled() else loss * float("nan")


def make():
    data = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    return Task(model=nn.Linear(2, 1), loss_fn=val_loss_nan, name="nanval", train_data=data, val_data=data,
                batch_size=4)
"""


def test_train_json_is_strict_json_when_a_figure_is_not_finite(tmp_path, redline_here):
    (tmp_path / "nan_task.py").write_text(NAN_VAL_TASK)
    out = tmp_path / "run"
    result = redline_here("train", "--task", f"{tmp_path / 'nan_task.py'}:make", "--max-steps", "2", "--no-progress",
                         "--json", "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout, parse_constant=lambda word: pytest.fail(f"{word} is not JSON"))
    assert summary["val_loss"] is None
    assert json.loads((out / "summary.json").read_text()) == summary


BRACKET_SAMPLE_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from redline.task import Task

SAMPLE = "def pick(xs: list[int]) -> int:  # xs[/0] [bold]"


def make():
    return Task(model=nn.Linear(2, 1), loss_fn=nn.functional.mse_loss, name="brackets", batch_size=4,
                train_data=TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), sample=lambda model: SAMPLE)
"""


def test_train_prints_a_generated_sample_as_written_brackets_and_all(tmp_path, redline_here):
    (tmp_path / "bracket_task.py").write_text(BRACKET_SAMPLE_TASK)
    result = redline_here("train", "--task", f"{tmp_path / 'bracket_task.py'}:make", "--max-steps", "1",
                         "--no-progress", env={"COLUMNS": "200"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "def pick(xs: list[int]) -> int:  # xs[/0] [bold]" in result.stdout


def test_bench_warns_of_a_failed_memory_estimate_with_its_error_as_written(monkeypatch):
    from rich.console import Console

    from redline.cli import bench as bench_cli

    def fails(*args, **kwargs):
        raise RuntimeError("cannot trace [fc.weight] under [/tmp/x]")

    monkeypatch.setattr(bench_cli, "estimate_memory", fails)
    console = Console(width=300, record=True)
    assert bench_cli._estimator(load_task("example:digits"), console)(8, "fp32", "cpu") is None
    assert "cannot trace [fc.weight] under [/tmp/x]" in console.export_text()


def test_task_arg_false_reaches_a_bool_option_as_false(tmp_path, redline_here):
    (tmp_path / "flag_task.py").write_text(FLAG_TASK)
    spec = f"{tmp_path / 'flag_task.py'}:make"
    args = ("train", "--task", spec, "--max-steps", "1", "--no-progress", "--json")
    result = redline_here(*args, "--task-arg", "flag=false", "--task-arg", "name=123")
    assert result.returncode == 0, result.stderr  # the factory raises when flag is truthy
    assert json.loads(result.stdout)["task"] == "123"  # str option: the text as typed, not the number


CHATTY_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline

print("task file imported")


def make():
    print("loading 64 samples")
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    return redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8, name="chatty")
"""


def test_what_a_task_file_prints_goes_to_stderr_under_json_and_stdout_holds_the_json_alone(tmp_path, redline_here):
    """Before, the factory's print came first on stdout: `train --json | jq` read no JSON."""
    (tmp_path / "chatty.py").write_text(CHATTY_TASK)
    result = redline_here("train", "--task", f"{tmp_path / 'chatty.py'}:make", "--max-steps", "1", "--no-progress",
                          "--devices", "cpu", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["task"] == "chatty"
    assert "task file imported\nloading 64 samples\n" in result.stderr
    table = redline_here("train", "--task", f"{tmp_path / 'chatty.py'}:make", "--max-steps", "1", "--no-progress",
                         "--devices", "cpu")  # fmt: skip
    assert table.returncode == 0 and table.stdout.startswith("task file imported\nloading 64 samples\n")


LOUD_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline


class Loud(nn.Linear):
    def forward(self, x):
        print("debug: forward of", tuple(x.shape))
        return super().forward(x)


def make():
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    return redline.Task(model=lambda: Loud(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8, name="loud")
"""


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--devices", "cpu", "--max-steps", "2", "--no-progress"],
        ["profile", "--devices", "cpu", "--steps", "1", "--warmup", "1"],
        [
            "bench",
            "--devices",
            "cpu",
            "--steps",
            "2",
            "--precision",
            "fp32",
            "--compile",
            "off",
            "--no-auto",
            "--no-estimate",
        ],
        ["memory", "--measure", "--start", "8", "--max-batch-size", "8"],
    ],
)
def test_what_the_model_prints_as_it_runs_goes_to_stderr_under_json(tmp_path, redline_here, command):
    """Before, only what the task file printed as it loaded went to stderr: a model printing in its forward put its
    lines before the JSON on stdout, for train, memory, profile, bench and tune alike."""
    (tmp_path / "loud.py").write_text(LOUD_TASK)
    name, *flags = command
    result = redline_here(name, "--task", f"{tmp_path / 'loud.py'}:make", *flags, "--json")
    assert result.returncode == 0, result.stderr
    json.loads(result.stdout)
    assert "debug: forward of (8, 4)" in result.stderr


def test_task_arg_that_does_not_convert_is_one_clear_line(tmp_path, redline_here):
    (tmp_path / "flag_task.py").write_text(FLAG_TASK)
    spec = f"{tmp_path / 'flag_task.py'}:make"
    result = redline_here("train", "--task", spec, "--max-steps", "1", "--task-arg", "flag=maybe")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--task-arg flag='maybe': the factory's option 'flag' is a bool; expected true or false" in result.stderr
    assert "hint: e.g. --task-arg flag=true" in result.stderr


def test_warnings_reach_stderr_through_the_one_logger(tmp_path, redline_here):
    result = redline_here(
        "train", "--task", "example:digits", "--max-steps", "1", "--out", str(tmp_path), "--resume", "auto", "--json"
    )
    assert result.returncode == 0, result.stderr
    assert f"warning: no checkpoint under {tmp_path / 'checkpoints'}; starting from scratch" in result.stderr
    json.loads(result.stdout)  # stdout still holds the JSON alone


def test_a_launch_option_without_nproc_is_refused_with_the_fix(redline_here):
    result = redline_here("train", "--task", "example:digits", "--max-steps", "1", "--max-restarts", "2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--max-restarts concerns the worker processes that --nproc starts" in result.stderr
    assert "hint: add --nproc N" in result.stderr


MLP_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline


def mlp(hidden: int = 16):
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randint(0, 2, (32,), generator=gen))
    return redline.Task(model=lambda: nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2)),
                        loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8)
"""


def test_resuming_into_the_run_of_another_model_says_so_in_one_message(tmp_path, redline_here):
    (tmp_path / "mlp_task.py").write_text(MLP_TASK)
    task, out = f"{tmp_path / 'mlp_task.py'}:mlp", tmp_path / "run"
    first = redline_here("train", "--task", task, "--out", str(out), "--max-steps", "2", "--json")
    assert first.returncode == 0, first.stderr
    again = redline_here(
        "train", "--task", task, "--task-arg", "hidden=8", "--out", str(out), "--resume", "auto", "--max-steps", "4"
    )
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert "Missing key" not in again.stderr and "size mismatch" not in again.stderr
    message = " ".join(again.stderr.split())  # as one line, however the terminal wrapped it
    assert (
        f"error: {out / 'checkpoints' / 'step-00000002'}: the checkpoint's model differs from this run's model: "
        "shapes differ: 0.weight ([16, 4] in the checkpoint, [8, 4] in this model), 0.bias ([16] in the "
        "checkpoint, [8] in this model), 2.weight ([2, 16] in the checkpoint, [2, 8] in this model)" in message
    )
    assert (
        "hint: this run's model is not the one that wrote the checkpoint (another --task-arg, or changed model "
        "code, changes its shapes): resume with the same --task-arg values as the run that wrote it, or load a "
        "checkpoint of this model "
        "(redline train: --resume one of this model, or another --out)" in message
    )


def start_training(out, *args: str, env=None) -> subprocess.Popen:
    """Start `redline train` on the digits for far longer than a test waits; return once it has logged a step."""
    command = [sys.executable, "-m", "redline", "train", "--task", "example:digits", "--max-steps", "100000",
               "--epochs", "10000", "--log-every", "1", "--out", str(out), *args]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out / "metrics.csv").is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc


def test_sigterm_stops_one_process_with_exit_143_after_the_summary_and_a_checkpoint(tmp_path):
    out, finished = tmp_path / "run", tmp_path / "finished"
    proc = start_training(out, "--json", env={"REDLINE_FINISHED_FILE": str(finished)})
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    summary = json.loads(stdout)  # printed first, as for a run that finished
    assert summary["stopped"] == "signal SIGTERM"
    checkpoint = out / "checkpoints" / f"step-{summary['steps']:08d}"
    assert summary["checkpoint"] == str(checkpoint) and (checkpoint / "manifest.json").is_file()
    message = " ".join(stderr.split())
    assert f"error: stopped by SIGTERM at step {summary['steps']}, its checkpoint written to {checkpoint}" in message
    assert "hint: run the same command again with --resume auto to continue from it" in message
    assert "Traceback" not in stderr
    assert not finished.exists(), "a stopped run must not tell a launcher that it finished"


def test_resuming_a_stopped_run_with_no_steps_left_exits_0_not_as_if_stopped_again(tmp_path, redline_here):
    out = tmp_path / "run"
    proc = start_training(out, "--json")
    proc.send_signal(signal.SIGTERM)
    stopped = json.loads(proc.communicate(timeout=120)[0])
    assert proc.returncode == 128 + signal.SIGTERM and stopped["steps"] >= 1
    again = redline_here("train", "--task", "example:digits", "--max-steps", "1", "--out", str(out), "--resume", "auto",
                        "--json")  # fmt: skip
    assert again.returncode == 0, again.stderr  # nothing stopped it now: a 143 would tell a scheduler to retry
    assert json.loads(again.stdout) == stopped  # the run's summary, left as it was
    message = " ".join(again.stderr.split())
    assert f"the run in {out} was stopped at step {stopped['steps']} (by signal SIGTERM)" in message
    steps = stopped["steps"]  # --max-steps 1 under it reads as "1 more": the hint says how to ask for that
    hint = f"to train 1 more, pass --max-steps {steps + 1}" if steps > 1 else "to train it further, raise --max-steps"
    assert f"hint: {hint}" in message and "error:" not in message


def test_a_run_that_finished_its_work_exits_0_and_says_so_to_the_launcher(tmp_path, redline_here):
    finished = tmp_path / "finished"
    result = redline_here("train", "--task", "example:digits", "--max-steps", "1", "--json",
                         env={"REDLINE_FINISHED_FILE": str(finished)})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stopped"] == "max_steps" and finished.is_file()


def test_sigterm_to_the_launcher_of_one_worker_exits_143_after_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = start_training(out, "--nproc", "1")
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler sends it; torchrun passes it on
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "error: stopped by SIGTERM: the launcher passed it to every worker" in stderr and "--resume auto" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "signal SIGTERM" and summary["checkpoint"].endswith(f"step-{summary['steps']:08d}")
    named = f"the newest checkpoint under --out is step {summary['steps']}, at {summary['checkpoint']}\n"
    assert named in stderr  # where a resume goes on from, as a one-process run says it
    assert (out / "checkpoints" / f"step-{summary['steps']:08d}" / "manifest.json").is_file()


def test_sigint_without_out_exits_130_and_says_nothing_was_saved():
    trainer = Trainer(load_task("example:digits"), runtime=RuntimeOptions(devices="cpu"), max_steps=1, progress=False)
    summary = dataclasses.replace(trainer.fit(), stopped="signal SIGINT")  # as the Trainer reports a Ctrl-C
    stopped = stopped_early(summary)
    assert stopped.exit_code == 130
    assert str(stopped) == (
        "stopped by SIGINT at step 1; nothing was saved: the run has no --out\n"
        "hint: pass --out DIR to write a checkpoint there that the run can continue from (--resume auto)"
    )


CTRL_C_TWICE_TASK = """
import os
import signal
from pathlib import Path

from redline.examples.digits import digits

fired = False


def loss_then_ctrl_c_twice(outputs, targets):  # in fit's loop, once WAIT_FOR exists: Ctrl-C, and again as it stops
    global fired
    if type(getattr(signal.getsignal(signal.SIGINT), "__self__", None)).__name__ == "StopOnSignal" and not fired:
        if Path(os.environ.get("WAIT_FOR", ".")).exists():
            fired = True
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
    return task.loss_fn(outputs, targets)


task = digits()


def make():
    import dataclasses

    return dataclasses.replace(task, loss_fn=loss_then_ctrl_c_twice)
"""


def test_a_second_ctrl_c_exits_130_naming_the_last_checkpoint_or_that_nothing_was_saved(tmp_path):
    """It exited 130 without a word of what was on disk."""
    (tmp_path / "twice.py").write_text(CTRL_C_TWICE_TASK)
    train = ("train", "--task", f"{tmp_path / 'twice.py'}:make", "--max-steps", "10", "--no-progress")
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    saved = redline_cli(*train, "--out", str(tmp_path / "run"), "--checkpoint-every", "2",
                        env={"WAIT_FOR": str(checkpoint)})  # fmt: skip
    assert saved.returncode == 130, saved.stderr[-3000:]
    assert (
        f"error: aborted by a second SIGINT while the run was stopping; its last checkpoint is {checkpoint} (step 2)\n"
        "hint: run the same command again with --resume auto to continue from it"
    ) in saved.stderr
    unsaved = redline_cli(*train)
    assert unsaved.returncode == 130, unsaved.stderr[-3000:]
    assert "stopping; nothing was saved: the run has no --out\nhint: pass --out DIR" in unsaved.stderr
    assert "Traceback" not in saved.stderr + unsaved.stderr


CTRL_C_AT_THE_END_TASK = """
import os
import signal

from redline.examples.digits import digits

calls = 0


def accuracy_then_ctrl_c(outputs, targets):  # the final evaluation's first batch: the steps are done
    global calls
    calls += 1
    if calls == 2:  # the first: val_data's first batch, checked after step 1
        for _ in range(int(os.environ["CTRL_C"])):
            os.kill(os.getpid(), signal.SIGINT)
    return task.metric(outputs, targets)


task = digits()


def make():
    import dataclasses

    return dataclasses.replace(task, metric=accuracy_then_ctrl_c)
"""


def test_a_ctrl_c_after_the_last_step_says_the_results_are_being_written_and_a_second_skips_them(tmp_path):
    """A Ctrl-C in the final evaluation was silently ignored; a second said 'while the run was stopping'."""
    (tmp_path / "end.py").write_text(CTRL_C_AT_THE_END_TASK)
    train = ("train", "--task", f"{tmp_path / 'end.py'}:make", "--max-steps", "3", "--no-progress", "--trial", "off")
    once = redline_cli(*train, "--out", str(tmp_path / "once"), env={"CTRL_C": "1"})
    assert once.returncode == 0, once.stderr[-3000:]
    assert "SIGINT: the run has finished its steps and is writing its results" in once.stderr
    assert (tmp_path / "once" / "summary.json").is_file()
    run = tmp_path / "twice"
    twice = redline_cli(*train, "--out", str(run), env={"CTRL_C": "2"})
    assert twice.returncode == 130, twice.stderr[-3000:]
    checkpoint = run / "checkpoints" / "step-00000003"
    assert (
        "error: aborted by a second SIGINT after the run's last step, before its results were written; its last "
        f"checkpoint is {checkpoint} (step 3)\nhint: run the same command again with --resume auto to write them"
    ) in twice.stderr
    assert not (run / "summary.json").exists() and "Traceback" not in twice.stderr
    resumed = redline_cli(*train, "--out", str(run), "--resume", "auto", env={"CTRL_C": "0"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 3 and (run / "model.safetensors").is_file()


SIGTERM_AS_THE_MODEL_IS_BUILT_TASK = """
import os
import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline


def model():  # a scheduler's SIGTERM while the run sets up (a large model loading), before the run takes signals
    os.kill(os.getpid(), signal.SIGTERM)
    return nn.Linear(4, 2)


def make():
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    return redline.Task(model=model, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8, name="t")
"""


def test_a_sigterm_while_the_run_sets_up_says_so_and_exits_143(tmp_path):
    """The process ended by the signal with no word (status -15)."""
    (tmp_path / "term.py").write_text(SIGTERM_AS_THE_MODEL_IS_BUILT_TASK)
    run = tmp_path / "run"
    done = redline_cli("train", "--task", f"{tmp_path / 'term.py'}:make", "--max-steps", "3", "--out", str(run))
    assert done.returncode == 143, done.stderr[-3000:]
    assert f"error: interrupted by SIGTERM, before its first checkpoint: nothing was saved under {run}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_ctrl_c_before_the_loop_says_it_was_not_a_second_one_and_what_is_saved(tmp_path):
    from redline.cli.train import LastCheckpoint, aborted

    first = aborted(LastCheckpoint(), tmp_path / "run", second=False)  # in the set-up: no handler of the run's yet
    assert first.exit_code == 130
    assert str(first) == (
        f"interrupted by SIGINT, before its first checkpoint: nothing was saved under {tmp_path / 'run'}\n"
        "hint: once it trains, one Ctrl-C stops the run after its step with a checkpoint; wait for it to be written"
    )
    second = aborted(LastCheckpoint(), tmp_path / "run", second=True)  # 20 steps trained: not "once it trains"
    assert str(second).endswith(
        "hint: one Ctrl-C stops the run after the step or evaluation under way, with a checkpoint of its steps; wait "
        "for it to be written"
    )


def test_a_tensorboard_logger_without_out_is_refused_with_the_fix(redline_here):
    result = redline_here("train", "--task", "example:digits", "--max-steps", "1", "--logger", "tensorboard")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "logger 'tensorboard' writes its files under out_dir, and out_dir is None" in result.stderr
    assert "hint: pass --out DIR" in result.stderr


def test_a_checkpoint_flag_typed_with_its_default_value_without_out_is_refused_too(redline_here):
    # --keep-checkpoints 3 (the default's value) without --out was accepted, and kept nothing, unsaid
    for flag, value, said in (("--keep-checkpoints", "3", "3"), ("--checkpoint-minutes", "30", "30.0")):
        result = redline_here("train", "--task", "example:digits", "--max-steps", "1", flag, value)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"{flag}={said} is not allowed; expected it with --out DIR" in result.stderr
        assert "hint: add --out DIR" in result.stderr


# What pip writes as the `redline` console script: sys.path starts with the script's folder, not the
# working directory (where `python -m redline` would put it).
CONSOLE_SCRIPT = "import sys\nfrom redline.cli.main import main\nsys.exit(main())\n"


def test_console_script_finds_a_module_spec_in_the_working_directory(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "redline").write_text(CONSOLE_SCRIPT)
    work = tmp_path / "work"
    (work / "mypkg").mkdir(parents=True)
    (work / "mypkg" / "__init__.py").write_text("")
    (work / "mypkg" / "tasks.py").write_text(FLAG_TASK)
    redline = [sys.executable, str(tmp_path / "bin" / "redline"), "train", "--max-steps", "1", "--json"]
    found = subprocess.run(
        [*redline, "--task", "mypkg.tasks:make", "--task-arg", "flag=off", "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=work,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["task"] == "tiny"
    missing = subprocess.run([*redline, "--task", "otherpkg.tasks:make"], capture_output=True, text=True, cwd=work)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "module 'otherpkg.tasks' not found" in missing.stderr
    assert "hint: run redline in the folder that holds otherpkg/" in missing.stderr


# A factory that builds its module at once (not a callable): its weights come from the RNG as it
# stands when the factory runs. The data is fixed, so the loss differs only if the weights do.
EAGER_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.task import Task


def make():
    inputs = torch.linspace(-1, 1, 32).reshape(8, 4)
    return Task(model=nn.Linear(4, 1), loss_fn=nn.functional.mse_loss, batch_size=4,
                train_data=TensorDataset(inputs, inputs.sum(dim=1, keepdim=True)))
"""


def test_seed_makes_a_factory_built_model_repeat(tmp_path, redline_here):
    (tmp_path / "eager_task.py").write_text(EAGER_TASK)
    spec = f"{tmp_path / 'eager_task.py'}:make"

    def final_loss(seed: str) -> float:
        result = redline_here("train", "--task", spec, "--seed", seed, "--json", "--max-steps", "2", "--no-progress")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["final_loss"]

    first = final_loss("3")
    assert final_loss("3") == first
    assert final_loss("4") != first


def test_a_factory_that_builds_a_malformed_task_is_one_clear_line(tmp_path, redline_here):
    (tmp_path / "empty_task.py").write_text(EAGER_TASK.replace("linspace(-1, 1, 32).reshape(8, 4)", "empty(0, 4)"))
    result = redline_here("train", "--task", f"{tmp_path / 'empty_task.py'}:make", "--max-steps", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "the factory raised ConfigError: len(train_data)=0 is not allowed; expected at least one" in result.stderr
    assert "hint: check how train_data is built" in result.stderr
    # one hint, the refusal's own, after the line of the factory that built it (a second, generic hint followed it)
    lines = result.stderr.splitlines()
    assert [line for line in lines if line.startswith("hint:")] == [
        "hint: check how train_data is built: it holds no samples"
    ]
    assert lines[lines.index("hint: check how train_data is built: it holds no samples") - 1].startswith("  at ")


NORM_MODEL = "model=nn.Sequential(nn.BatchNorm1d(4), nn.Dropout(0.1), nn.Linear(4, 1))"
NORM_TASK = EAGER_TASK.replace("model=nn.Linear(4, 1)", NORM_MODEL)


def test_one_process_plan_has_no_split_caveats(tmp_path, redline_here):
    (tmp_path / "norm_task.py").write_text(NORM_TASK)
    spec = f"{tmp_path / 'norm_task.py'}:make"
    result = redline_here("train", "--task", spec, "--json", "--max-steps", "1", "--no-progress")
    assert result.returncode == 0, result.stderr
    loader = json.loads(result.stdout)["plan"]["loader"]["reason"]
    assert "global batch 4 = 1 x 4" in loader  # the line that carries the caveats under several processes
    assert "BatchNorm" not in loader and "dropout" not in loader


@pytest.mark.parametrize(("command", "columns"), [("train", 80), ("train", 100), ("launch", 80), ("doctor", 80)])
def test_help_shows_every_flag_name_whole(command, columns, redline_here):
    loaded = typer.main.get_command(app).commands[command].load()  # type: ignore[attr-defined]
    names = [name for param in loaded.params for name in (*param.opts, *param.secondary_opts) if name.startswith("-")]
    assert "--early-stopping-patience" in names or command != "train"
    result = redline_here(command, "--help", env={"COLUMNS": str(columns)})
    assert result.returncode == 0, result.stderr
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", result.stdout), name
    assert max(map(len, result.stdout.splitlines())) <= columns


@pytest.mark.slow
def test_chargpt_compiled_on_cpu_compiles_its_training_forward_once(redline_here):
    """The inductor compile of the CLI tier: evaluation each epoch, a partial last batch and sampling, one graph."""
    small = ["--task-arg", "n_layer=1", "--task-arg", "n_embd=32", "--task-arg", "n_head=2", "--task-arg",
             "block_size=16", "--task-arg", "max_chars=3000", "--task-arg", "batch_size=16"]  # fmt: skip
    result = redline_here("train", "--task", "example:chargpt", *small, "--compile", "on", "--epochs", "2", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["plan"]["compile"]["value"] is True
    assert "compiled 1 time(s)" in summary["plan"]["compile"]["reason"], summary["plan"]["compile"]["reason"]
    assert "a partial last batch is dropped" in summary["plan"]["loader"]["reason"]
    assert summary["val_loss"] is not None and summary["sample"]  # evaluated and sampled, eagerly


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--window", "0"],
        ["bench", "--steps", "0"],
        ["bench", "--planned-steps", "-3"],
        ["tune", "--steps", "0"],
        ["tune", "--batch-size", "0"],
        ["tune", "--planned-steps", "0"],
        ["memory", "--gpus", "0"],
        ["memory", "--batch-size", "0"],
        ["memory", "--start", "0"],
        ["profile", "--steps", "0"],
        ["profile", "--warmup", "0"],
        ["predict", "--batch-size", "0"],
        ["train", "--epochs", "0"],
        ["train", "--log-every", "0"],
        ["train", "--grad-accum", "0"],
        ["train", "--early-stopping-patience", "0"],
        ["serve", "--queue-size", "0"],
        ["serve", "--max-batch-size", "0"],
        ["loadtest", "--concurrency", "0"],
    ],
)
def test_a_count_below_one_is_refused_by_its_flag_before_anything_runs(args):
    from typer.testing import CliRunner

    positional = {"serve": ["example:digits"], "loadtest": ["http://127.0.0.1:9/"], "predict": ["example:digits"]}
    where = positional.get(args[0], ["--task", "example:digits"])
    result = CliRunner().invoke(app, [*args, *where])
    assert isinstance(result.exception, ConfigError)  # derived from an options object, or a command's own count
    assert str(result.exception) == (
        f"{args[1]}={args[2]} is not allowed; expected a positive integer\nhint: e.g. {args[1]} 1"
    )


@pytest.mark.parametrize("flag", ["--start", "--max-batch-size"])
def test_a_search_bound_without_measure_is_refused_not_ignored(flag):
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["memory", "--task", "example:digits", flag, "64"])
    assert isinstance(result.exception, ConfigError)  # exits 2 through main(), before any trace
    assert f"{flag} bounds the search that --measure runs" in str(result.exception)


def test_a_bench_whose_every_row_failed_prints_them_and_exits_with_the_first_error():
    from typer.testing import CliRunner

    task = ["--task", "tests/cpu/mistake_tasks.py:mistake", "--task-arg", "kind=attribute_error"]
    args = ["bench", *task, "--steps", "1", "--window", "1", "--compile", "off", "--precision", "fp32", "--json"]
    result = CliRunner().invoke(app, [*args, "--no-estimate"])
    assert isinstance(result.exception, TrainingError)  # main() exits 2 with it
    message = str(result.exception)
    assert "no configuration of attribute_error ran (3 failed); the first: AttributeError:" in message, message
    assert "redline train --task tests/cpu/mistake_tasks.py:mistake --task-arg kind=attribute_error" in message
    rows = json.loads(result.stdout)["rows"]  # the result is printed first: nothing measured is lost
    assert [bool(row["error"]) for row in rows] == [True, True, True]


def test_a_measure_start_past_its_cap_is_refused_by_the_flags_the_user_typed():
    from typer.testing import CliRunner

    args = ["memory", "--task", "example:digits", "--measure", "--start", "100", "--max-batch-size", "50"]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, ConfigError)
    message = str(result.exception)
    assert "--start=100 is not allowed; expected at most 50 (--max-batch-size 50)" in message, message
    assert "hint: pass --start 50 or less, or --max-batch-size 100 or more" in message, message
    assert "max_batch_size" not in message
    assert "running training steps" not in result.output  # refused before the search says it runs


def test_a_bad_task_spec_under_nproc_is_refused_once_before_any_worker_starts(redline_here):
    result = redline_here("train", "--task", "example:nope", "--nproc", "2", "--max-steps", "1")
    assert result.returncode == 2
    assert result.stderr.count("no built-in example 'nope'") == 1
    assert "launched job" not in result.stderr and "torch.distributed" not in result.stderr


def test_cuda_graphs_asked_of_a_cpu_are_refused_by_the_flag_before_anything_runs():
    from typer.testing import CliRunner

    args = ["train", "--task", "example:digits", "--devices", "cpu", "--cuda-graphs", "on", "--max-steps", "2"]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, ConfigError)
    message = str(result.exception)
    assert "--cuda-graphs='on' is not allowed; expected 'auto' or 'off' on cpu" in message, message
    assert "CUDA graphs need a CUDA device" in message


def test_train_runs_the_attention_kernel_asked_for_and_refuses_one_the_device_lacks(redline_here):
    small = ["--task-arg", "n_layer=1", "--task-arg", "n_embd=32", "--task-arg", "n_head=2", "--task-arg",
             "block_size=16", "--task-arg", "max_chars=3000"]  # fmt: skip
    result = redline_here("train", "--task", "example:chargpt", *small, "--max-steps", "2", "--attention", "math",
                          "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)["plan"]
    assert plan["attention"] == {"value": "math", "reason": "requested: math for every call"}
    refused = redline_here("train", "--task", "example:chargpt", *small, "--max-steps", "1", "--attention", "cudnn")
    assert refused.returncode == 2
    assert "attention='cudnn' is not allowed; expected 'auto', 'flash' or 'math' on a CPU" in refused.stderr


WITHOUT = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):  # as an environment without the package
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == {missing!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
"""


def test_a_command_whose_extra_is_not_installed_names_the_extra_not_doctor():
    """`redline serve` without starlette said to run `redline doctor`, which checks torch."""
    script = WITHOUT.format(missing="starlette") + "from redline.cli.main import main; sys.exit(main())"
    ran = subprocess.run([sys.executable, "-c", script, "serve", "example:digits"], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.strip().splitlines()[-2:] == [
        "error: `redline serve` needs starlette, of redline's 'serve' extra, which is not installed",
        "hint: pip install 'redline[serve]'",
    ]


def test_the_engine_and_predict_need_no_package_of_the_serve_extra():
    """predict, a file in and a file out, failed without orjson, which only the server's JSON bodies use."""
    script = WITHOUT.format(missing="orjson") + (
        "import numpy, torch, redline\n"
        "engine = redline.InferenceEngine(torch.nn.Linear(3, 2), input_shape=(3,), measure='off')\n"
        "print(tuple(engine.predict(numpy.zeros((4, 3), numpy.float32)).shape))\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.strip() == "(4, 2)", ran.stderr


SPLIT_TASK = """
import json, os, torch
from torch import nn
from torch.utils.data import Subset, TensorDataset
import redline

def task():
    inputs = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(inputs, torch.zeros(40, dtype=torch.long))
    order = torch.randperm(40).tolist()  # the split, drawn from torch's random stream as many factories draw it
    with open(os.environ["SPLIT_FILE"], "a") as f:
        f.write(json.dumps(order[:8]) + "\\n")
    return redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy,
                        train_data=Subset(data, order[8:]), val_data=Subset(data, order[:8]), batch_size=8)
"""


def test_a_resumed_run_builds_its_task_under_the_checkpoints_seed(tmp_path, monkeypatch):
    """--seed 2 on a resume of a --seed 1 run drew another train/val split, the data position going on over it."""
    (tmp_path / "split.py").write_text(SPLIT_TASK)
    monkeypatch.setenv("SPLIT_FILE", str(tmp_path / "splits.jsonl"))
    spec, out = f"{tmp_path / 'split.py'}:task", str(tmp_path / "run")
    from typer.testing import CliRunner

    first = CliRunner().invoke(app, ["train", "--task", spec, "--out", out, "--max-steps", "2",
                                                   "--seed", "1", "--checkpoint-every", "2"])  # fmt: skip
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(app, ["train", "--task", spec, "--out", out, "--max-steps", "4",
                                                   "--seed", "2", "--resume", "auto"])  # fmt: skip
    assert again.exit_code == 0, again.output
    splits = (tmp_path / "splits.jsonl").read_text().splitlines()
    assert len(splits) == 2 and splits[0] == splits[1], "the resumed run validates on the rows the first one did"


def test_a_resume_path_with_nothing_there_under_nproc_is_refused_once_before_any_worker_starts(redline_here, tmp_path):
    """Before, each worker said 'no such checkpoint' in each attempt --max-restarts gave it."""
    missing = tmp_path / "missing" / "ck"
    result = redline_here("train", "--task", "example:digits", "--nproc", "2", "--max-restarts", "1", "--resume",
                          str(missing), "--max-steps", "1")  # fmt: skip
    assert result.returncode != 0 and result.stderr.count(f"{missing}: no such checkpoint") == 1, result.stderr
    assert "launched job" not in result.stderr and "torch.distributed" not in result.stderr


@pytest.mark.parametrize(("environ", "taken"), [({}, True), ({"RANK": "1", "MASTER_ADDR": "10.0.0.1"}, False)])
def test_a_launched_worker_leaves_a_sigterm_in_set_up_to_its_launcher(environ, taken):
    # a worker the launcher stopped (another rank failed) said "interrupted by SIGTERM" and exited 143, which the
    # launcher read as that rank's own failure: two errors and a hint about --out for a signal nobody sent
    from redline.cli.train import setting_up_signals

    before = signal.getsignal(signal.SIGTERM)
    with setting_up_signals(environ):
        assert (signal.getsignal(signal.SIGTERM) is not before) == taken
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_mistyped_contention_switch_is_refused_before_any_command_runs(monkeypatch):
    from typer.testing import CliRunner

    # it was refused at the first timing only: an estimate, or a run whose Plan was cached, never said a word
    monkeypatch.setenv("REDLINE_CONTENTION", "of")
    result = CliRunner().invoke(app, ["memory", "--task", "example:digits", "--json"])
    assert isinstance(result.exception, ConfigError)
    assert "REDLINE_CONTENTION='of' is not allowed; expected off or on" in str(result.exception)
    assert result.stdout == ""


def test_train_help_says_early_stoppings_defaults_which_the_flags_left_out_do_not_show():
    from typer.testing import CliRunner

    shown = " ".join(CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "400"}).output.split())
    assert "Stop after N evaluations without improvement (at least 1) (default: 3)." in shown
    assert "(any --early-stopping-* flag turns early stopping on) (default: val_loss)." in shown
    assert "(every visible GPU, else 1)." in shown  # --nproc left out runs in this process, not "auto"
