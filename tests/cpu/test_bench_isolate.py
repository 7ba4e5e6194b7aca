"""`redline bench --isolate`: each row built, warmed up and timed in a process of its own, as the table says."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.bench import benchmark
from redline.bench.isolate import RowEnded, RowProcess
from redline.bench.matrix import Setting
from redline.errors import ConfigError
from redline.task import task_origin

TASK_FILE = """
import logging, os
import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline


class Picky(nn.Module):
    def __init__(self, pids):
        super().__init__()
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\\n")
        logging.getLogger("redline.test_isolate").warning("model built in process %d", os.getpid())
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("no bf16 here (made up by the test)")
        return self.net(x)


class Dying(nn.Linear):  # killed, as the kernel kills a process out of memory, at its forward call number after

    def __init__(self, after):
        super().__init__(16, 4)
        self.after, self.calls = after, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.after:
            os.kill(os.getpid(), 9)
        return super().forward(x)


def make_dying_task(after: int) -> redline.Task:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
    return redline.Task(model=lambda: Dying(after), loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x, y),
                        batch_size=32, name="dying")


def make_unseeded(transform=None) -> redline.Task:  # data drawn from NumPy's global stream, as a quick script does
    import numpy as np

    x = torch.from_numpy(np.random.rand(256, 16).astype("float32"))
    y = torch.from_numpy(np.random.randint(0, 4, 256))
    return redline.Task(model=lambda: nn.Linear(16, 4), loss_fn=nn.functional.cross_entropy,
                        train_data=TensorDataset(x, y), batch_size=32, name="unseeded")


def make_task(pids: str) -> redline.Task:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
    return redline.Task(
        model=lambda: Picky(pids), loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x, y),
        batch_size=32, name="picky",
    )
"""


@pytest.fixture
def task_file(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "picky_task.py"
    path.write_text(textwrap.dedent(TASK_FILE))
    return path


def test_each_row_runs_in_a_process_of_its_own_and_a_failing_row_keeps_its_error(task_file, tmp_path, caplog):
    pids = tmp_path / "pids.txt"
    task = redline.load_task(f"{task_file}:make_task", pids=str(pids))
    pids.write_text("")  # the factory built no model; a row's process builds its own
    caplog.set_level(logging.WARNING, logger="redline")
    result = benchmark(
        task, devices="cpu", precisions=["fp32", "bf16-mixed"], compiles=[False], steps=10, window=5, auto=False,
        isolate=True,
    )  # fmt: skip
    assert result.isolated
    naive, fp32, bf16 = (result.row(name) for name in ("naive cpu fp32 b32", "cpu fp32 eager b32",
                                                       "cpu bf16-mixed eager b32"))  # fmt: skip
    for row in (naive, fp32):
        assert not row.error and row.samples_per_s > 0 and row.peak_mem_bytes > 0
        assert row.loss is not None and row.first_step_s > 0  # timed in the row's process, sent back
    assert naive.loss == pytest.approx(fp32.loss, rel=1e-5)  # same seed, same steps: the rows train alike
    assert "no bf16 here" in bf16.error and bf16.samples_per_s is None
    built_in = [int(line) for line in pids.read_text().split()]
    assert len(set(built_in)) == 3 and os.getpid() not in built_in  # one process per row, none of them this one
    said = [r.getMessage() for r in caplog.records if r.name == "redline.test_isolate"]
    assert sorted(said) == sorted(f"model built in process {pid}" for pid in built_in)  # each row's log came back


def test_a_row_whose_process_is_killed_while_it_is_timed_says_how_it_ended(task_file):
    task = redline.load_task(f"{task_file}:make_dying_task", after=12)  # past the warm-up, within the timing
    result = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=20, window=5, auto=False,
                       isolate=True)  # fmt: skip
    for row in result.rows:
        assert row.error.startswith("the row's process ended without an answer (killed by signal 9; killed for memory")
        assert row.samples_per_s is None


def test_rows_build_the_same_data_from_an_unseeded_factory_in_a_folder_that_shadows_the_standard_library(
    task_file, tmp_path, monkeypatch
):
    project = tmp_path / "project"
    project.mkdir()
    (project / "profile.py").write_text("raise RuntimeError('the project\\'s own profile.py was imported')\n")
    monkeypatch.chdir(project)  # `python -m` put the working directory before the standard library: every row died
    task = redline.load_task(f"{os.path.relpath(task_file)}:make_unseeded")  # a relative path, read from here
    monkeypatch.chdir(tmp_path)  # ... and still the same file once the working directory changed
    result = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=10, window=5, auto=False,
                       isolate=True)  # fmt: skip
    naive, fp32 = result.rows
    assert not naive.error and not fp32.error, (naive.error, fp32.error)
    assert naive.loss == pytest.approx(fp32.loss, rel=1e-6)  # each process drew the factory's data from one seed


def test_options_that_cannot_travel_to_a_rows_process_are_refused_before_any_row_starts(task_file):
    task = redline.load_task(f"{task_file}:make_unseeded", transform=lambda x: x)
    with pytest.raises(ConfigError, match="do not pickle") as refused:
        benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=10, window=5, isolate=True)
    assert "hint: pass the task's options as plain values" in str(refused.value)


def test_a_task_built_in_python_cannot_be_isolated_and_the_error_says_how_to_load_one():
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    task = redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy,
                        train_data=TensorDataset(x, y), batch_size=16)  # fmt: skip
    assert task_origin(task) is None
    with pytest.raises(ConfigError, match="load_task"):
        benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=10, window=5, isolate=True)


def test_a_row_whose_process_dies_fails_with_how_it_ended_not_a_hang(task_file, tmp_path):
    origin = (f"{task_file}:make_task", {"pids": str(tmp_path / "pids.txt")})
    row = RowProcess(origin, Setting("explicit", "cpu", "fp32", False, 32), {
        "window": 2, "planned": 10, "seed": 0, "threads": 1, "log_level": logging.WARNING,
    })  # fmt: skip
    try:
        row.warm_up()
        row._proc.send_signal(signal.SIGKILL)
        with pytest.raises(RowEnded, match="killed by signal 9"):
            row.run(2)
        with pytest.raises(RowEnded, match="killed by signal 9"):  # asked again: the request itself finds it gone
            row.run(2)
    finally:
        row.close()


def test_the_command_line_isolates_and_its_json_says_so(task_file, tmp_path, redline_here):
    pids = tmp_path / "pids.txt"
    result = redline_here(
        "bench", "--task", f"{task_file}:make_task", "--task-arg", f"pids={pids}", "--devices", "cpu",
        "--precision", "fp32", "--compile", "off", "--steps", "10", "--no-auto", "--no-estimate", "--isolate", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["isolated"] is True and [row["error"] for row in data["rows"]] == ["", ""]
    assert len(set(pids.read_text().split())) == 2  # each row built its model in its own process, not the command's


def test_an_installed_redline_puts_no_site_packages_before_the_standard_library(monkeypatch):
    from pathlib import Path

    from redline.bench import isolate

    holder = str(Path(isolate.__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", "/opt/mine")
    assert isolate._import_paths() == [os.path.realpath(holder), "/opt/mine"]  # a source tree: found through it
    monkeypatch.setattr(isolate.site, "getsitepackages", lambda: [holder])  # installed: its process finds it anyway
    assert isolate._import_paths() == ["/opt/mine"]


def test_redline_traceback_prints_a_failing_rows_own_traceback_from_its_process(task_file, tmp_path):
    # the bench's process printed its own stack only: the row's, where the user's line is, stayed in the row's
    pids = tmp_path / "pids.txt"
    command = [
        sys.executable, "-m", "redline", "bench", "--task", f"{task_file}:make_task", "--task-arg", f"pids={pids}",
        "--devices", "cpu", "--precision", "bf16-mixed", "--compile", "off", "--steps", "4", "--no-auto",
        "--no-estimate", "--isolate", "--json",
    ]  # fmt: skip
    for asked in ("1", "0"):
        env = {**os.environ, "REDLINE_TRACEBACK": asked}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240, check=False)
        assert done.returncode == 0, done.stderr
        assert "no bf16 here" in json.loads(done.stdout)["rows"][1]["error"]
        printed = 'raise RuntimeError("no bf16 here' in done.stderr
        assert printed == (asked == "1") and ("Traceback" in done.stderr) == (asked == "1"), done.stderr
