"""`redline bench` failing: a row's failure is confined to its row wherever in its steps it comes, and a bench
refused before it runs leaves nothing behind, nor writes its page over the task's own file."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from redline.bench import benchmark
from redline.cli.bench import bench as bench_command
from redline.errors import ConfigError, RedlineError, TaskError, TrainingError
from redline.task import Task


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "cache"))


class FailsAtBatch(nn.Module):
    """An MLP whose ``fail_at``-th forward on a batch of ``size`` fails (as a kernel missing for a shape does)."""

    def __init__(self, size: int, fail_at: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.size, self.fail_at, self.calls = size, fail_at, 0

    def forward(self, x):
        if not x.is_meta and x.shape[0] == self.size:  # the FLOP count traces on the meta device: not a step
            self.calls += 1
            if self.calls >= self.fail_at:
                raise RuntimeError(f"no kernel for a batch of {self.size} (made up by the test)")
        return self.net(x)


def late_task(size: int, fail_at: int) -> Task:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, 16, generator=generator), torch.randint(0, 4, (128,), generator=generator)
    return Task(
        model=lambda: FailsAtBatch(size, fail_at), loss_fn=nn.functional.cross_entropy,
        train_data=TensorDataset(x, y), batch_size=32, name="late",
    )  # fmt: skip


def test_a_row_that_fails_on_the_step_after_its_timing_fails_alone_and_the_bench_goes_on():
    # window 1, steps 2: a warm-up step, then two rounds of a settling step and a timed one; the 6th step is
    # the one more step whose loss the table shows. It failed out of the bench, losing every row measured.
    task = late_task(size=16, fail_at=6)
    result = benchmark(
        task, devices="cpu", precisions=["fp32"], compiles=[False], batch_sizes=[32, 16], steps=2, window=1,
        auto=False,
    )  # fmt: skip
    by_size = {size: [row for row in result.rows if row.batch_size == size] for size in (32, 16)}
    assert [row.name for row in by_size[32]] == ["naive cpu fp32 b32", "cpu fp32 eager b32"]
    for row in by_size[32]:
        assert not row.error and row.samples_per_s > 0 and math.isfinite(row.loss)
    assert len(by_size[16]) == 2
    for row in by_size[16]:
        assert "RuntimeError: no kernel for a batch of 16" in row.error
        assert row.samples_per_s is None and row.loss is None


class Stream(IterableDataset):
    """A stream of ``count`` samples a pass, with no length: a batch size past it is found only when it runs."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for _ in range(self.count):
            yield torch.randn(16, generator=generator), torch.randint(0, 4, (), generator=generator)


def stream_task(count: int) -> Task:
    return Task(
        model=lambda: nn.Sequential(nn.Linear(16, 4)), loss_fn=nn.functional.cross_entropy, train_data=Stream(count),
        batch_size=16, name="stream",
    )  # fmt: skip


def test_a_batch_size_the_stream_cannot_fill_fails_its_rows_and_keeps_the_sizes_measured():
    # The stream's 40 samples fill a batch of 32, not one of 64: the bench raised at 64, losing the rows of 32.
    result = benchmark(
        stream_task(40), devices="cpu", precisions=["fp32"], compiles=[False], batch_sizes=[32, 64], steps=2,
        window=1, auto=False,
    )  # fmt: skip
    assert [(row.batch_size, bool(row.samples_per_s)) for row in result.rows] == [
        (32, True),
        (32, True),
        (64, False),
        (64, False),
    ]
    for row in result.rows[2:]:
        assert row.error.startswith("train_data gave no full batch of 64: a pass over it yields fewer samples\nhint:")
    with pytest.raises(TaskError, match="no full batch of 64"):  # at every size: the task's error, raised
        benchmark(stream_task(40), devices="cpu", precisions=["fp32"], compiles=[False], batch_sizes=[64], steps=2,
                  window=1, auto=False)  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"precision": "bf16"}, "precision 'bf16' is not one of"),
        ({"batch_size": "100000"}, "fewer than the batch size 100000"),
        ({"compile": "maybe"}, "--compile 'maybe': expected on and/or off"),
    ],
)
def test_a_bench_refused_before_it_runs_leaves_no_directory_for_its_page(tmp_path, flags, message):
    # The page's directory was made before the flags were read: a mistyped flag left it behind, empty.
    page = tmp_path / "reports" / "today" / "bench.html"
    with pytest.raises(RedlineError, match=message):
        bench_command(task="example:digits", devices="cpu", html=page, **flags)
    assert not (tmp_path / "reports").exists()


MLP_TASK_FILE = (  # a task file of one small task, `mlp`
    "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\nfrom redline import Task\n"
    "def mlp():\n    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))\n"
    "    return Task(model=lambda: nn.Linear(8, 3), loss_fn=nn.functional.cross_entropy,\n"
    "                train_data=TensorDataset(x, y), batch_size=16, name='mlp')\n"
)


def test_a_page_asked_over_the_tasks_own_file_is_refused_before_the_bench_and_the_file_kept(tmp_path, monkeypatch):
    # `--html tasks.py` for `--task tasks.py:mlp` replaced the task's code with the bench's page.
    def no_bench(*args, **kwargs):
        raise AssertionError("the bench ran, and its page would replace the task's file")

    source = tmp_path / "tasks.py"
    source.write_text(MLP_TASK_FILE)
    code = source.read_text()
    monkeypatch.setattr("redline.cli.bench.benchmark", no_bench)
    told = r"--html '.*tasks\.py' is the task's own file \(.*tasks\.py:mlp\): the page would replace its code\nhint: "
    with pytest.raises(ConfigError, match=told + r"name another file, e\.g\. --html .*tasks\.html"):
        bench_command(task=f"{source}:mlp", devices="cpu", html=source)
    monkeypatch.chdir(tmp_path)  # the same file by another path
    with pytest.raises(ConfigError, match=told):
        bench_command(task=f"{source}:mlp", devices="cpu", html=Path("tasks.py"))
    assert source.read_text() == code


def test_a_page_asked_where_stdout_goes_is_refused_before_the_bench(tmp_path):
    # `redline bench --json --html out.html > out.html`: the shell empties out.html and sends stdout there, the
    # page was written in its place, and the JSON printed to it was lost
    source = tmp_path / "tasks.py"
    source.write_text(MLP_TASK_FILE)
    page, kept = tmp_path / "out.html", os.dup(1)
    try:
        with page.open("w") as out:
            os.dup2(out.fileno(), 1)
            with pytest.raises(ConfigError, match=r"the file stdout goes to \(`> .*out.html`\).*\nhint: .*out.json"):
                bench_command(task=f"{source}:mlp", devices="cpu", json_output=True, html=page)
    finally:
        os.dup2(kept, 1)
        os.close(kept)
    assert page.read_text() == ""  # refused before the bench ran


def test_a_page_asked_to_dev_null_where_stdout_goes_too_is_not_refused(tmp_path, monkeypatch):
    # `redline bench --html /dev/null > /dev/null` was refused as "the file stdout goes to": a device is written
    # into, not replaced, so only a regular file is guarded
    class Ran(Exception):
        pass

    def ran(*args, **kwargs):
        raise Ran

    source = tmp_path / "tasks.py"
    source.write_text(MLP_TASK_FILE)
    monkeypatch.setattr("redline.cli.bench.benchmark", ran)
    kept = os.dup(1)
    try:
        with open(os.devnull, "w") as out:
            os.dup2(out.fileno(), 1)
            with pytest.raises(Ran):
                bench_command(task=f"{source}:mlp", devices="cpu", json_output=True, html=Path(os.devnull))
    finally:
        os.dup2(kept, 1)
        os.close(kept)


def test_a_bench_that_ran_nothing_names_the_one_step_run_at_its_batch_size_and_device(tmp_path, capsys):
    # The one-step run left out --batch-size: at the task's own size a batch too large to run ran, and showed
    # no failing line.
    source = tmp_path / "tasks.py"
    source.write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\nfrom redline import Task\n"
        "def mlp(features='7'):\n    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))\n"
        "    return Task(model=lambda: nn.Linear(int(features), 3), loss_fn=nn.functional.cross_entropy,\n"
        "                train_data=TensorDataset(x, y), batch_size=16, name='mlp')\n"
    )
    with pytest.raises(TrainingError, match=r"no configuration of mlp ran \(3 failed\)") as refused:
        bench_command(task=f"{source}:mlp", task_arg=["features=7"], devices="cpu", precision="fp32", compile="off",
                      batch_size="8", steps=1, window=1, estimate=False)  # fmt: skip
    one = f"redline train --task {source}:mlp --task-arg features=7 --batch-size 8 --devices cpu --max-steps 1"
    assert f"`{one}` runs one step" in str(refused.value)
    assert "failed" in capsys.readouterr().out  # the rows were shown first


def test_a_bench_whose_every_row_failed_says_no_step_was_timed(capsys):
    # It said "10 timed steps per row" in its title, its JSON's steps and its page's subtitle: the rounds asked
    result = benchmark(late_task(32, 1), devices="cpu", precisions=["fp32"], compiles=[False], steps=10, window=5)
    assert all(row.error for row in result.rows) and result.steps == 0 and result.steps_asked == 10
    from redline.render.bench import steps_told

    told = steps_told(result.to_dict())
    assert told.startswith("no row was timed (10 steps asked, in windows of 5)") and "timed steps per row" not in told


def test_with_json_the_page_written_is_said_on_stderr_and_stdout_stays_json(tmp_path, capsys):
    # With --json the page was written without a word: stdout must stay JSON, so it is said on stderr.
    page = tmp_path / "pages" / "bench.html"
    bench_command(task="example:digits", devices="cpu", precision="fp32", compile="off", auto=False, steps=1,
                  window=1, estimate=False, json_output=True, html=page)  # fmt: skip
    said = capsys.readouterr()
    assert json.loads(said.out)["task"] == "digits"
    assert f"report: {page}" in said.err and page.is_file()


class OnlyBuffers(nn.Module):
    """A model whose tensors are buffers: nothing to train."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(8, 2))

    def forward(self, x):
        return x @ self.w


BUFFERS_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from redline import Task
from test_bench_failures import OnlyBuffers

def buffers():
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    return Task(model=OnlyBuffers, loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x, y),
                batch_size=16, name="buffers")
"""


def test_a_model_with_nothing_to_train_is_named_so_by_the_naive_row_the_trial_and_the_failed_bench(
    tmp_path, monkeypatch
):
    # The naive loop's and the precision trial's optimizers raised torch's "optimizer got an empty parameter list",
    # which the bench's final error quoted, and `redline memory --measure` ended in its traceback.
    from redline.parallel.env import DistEnv
    from redline.runtime.measure import measure_auto
    from redline.runtime.options import RuntimeOptions

    monkeypatch.setenv("REDLINE_CPU", "amx")  # a CPU where the trial times bf16-mixed against fp32
    (tmp_path / "tasks.py").write_text(BUFFERS_TASK)
    spec = f"{tmp_path / 'tasks.py'}:buffers"
    with pytest.raises(TrainingError) as failed:
        bench_command(task=spec, devices="cpu", precision="fp32", compile="off", steps=2, window=1, estimate=False)
    said = str(failed.value)
    assert "the first: the model (OnlyBuffers) has no parameters: there is nothing to train\nhint: its tensors" in said
    assert "register_buffer" in said and "--max-steps 1` runs one step" in said and "empty parameter list" not in said
    task = Task(model=OnlyBuffers, loss_fn=nn.functional.cross_entropy, batch_size=16, name="buffers",
                train_data=TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))))  # fmt: skip
    with pytest.raises(ConfigError, match=r"has no parameters: there is nothing to train"):
        measure_auto(task, RuntimeOptions(devices="cpu"), 16, 5000, DistEnv(), trial="on")


def test_a_batch_norm_given_one_sample_is_named_with_its_fix_by_the_run_and_the_bench_rows():
    # The run said "check that the dataset's items are (inputs, targets) shaped as the model expects", and the
    # bench's rows torch's bare ValueError.
    from redline.train.trainer import Trainer

    def normed() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))

    task = Task(model=normed, loss_fn=nn.functional.cross_entropy, batch_size=1, name="normed",
                train_data=TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))))  # fmt: skip
    with pytest.raises(TrainingError, match=r"step 1: the model raised ValueError: Expected more than 1 value") as e:
        Trainer(task, max_steps=2, progress=False, trial="off").fit()
    assert "\nhint: a batch norm layer normalises each channel over the batch, so it cannot" in str(e.value)
    result = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], batch_sizes=[1, 4], steps=2,
                       window=1, auto=False)  # fmt: skip
    failed = [row for row in result.rows if row.batch_size == 1]
    assert failed and all("so it cannot train on one sample: use batches of 2 or more" in row.error for row in failed)
    assert all(not row.error for row in result.rows if row.batch_size == 4)


def test_a_view_of_an_nhwc_output_under_channels_last_on_is_named_with_its_fixes():
    from redline.runtime.options import RuntimeOptions
    from redline.train.trainer import Trainer

    class Viewed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 6 * 6, 2)

        def forward(self, x):
            return self.head(self.conv(x).view(len(x), -1))

    task = Task(model=Viewed, loss_fn=nn.functional.cross_entropy, batch_size=8, name="viewed",
                train_data=TensorDataset(torch.randn(32, 3, 6, 6), torch.randint(0, 2, (32,))))  # fmt: skip
    options = RuntimeOptions(devices="cpu", channels_last="on", precision="fp32", compile="off")
    with pytest.raises(TrainingError, match=r"view size is not compatible") as e:
        Trainer(task, runtime=options, max_steps=2, progress=False, trial="off").fit()
    assert "\nhint: .view needs a contiguous tensor, and with channels_last on a convolution's output" in str(e.value)
    assert "use .reshape(...) there, or channels_last auto (which keeps such a model NCHW) or off" in str(e.value)


def test_a_loss_of_per_sample_values_is_named_as_the_tasks_loss_in_a_runtime_row():
    """The bench's rows said `backward(loss) got a tensor of shape (16, 1)` where train says what the task returned."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 16, generator=generator), torch.randn(64, 1, generator=generator)
    task = Task(model=lambda: nn.Linear(16, 1), loss_fn=lambda o, t: nn.functional.mse_loss(o, t, reduction="none"),
                train_data=TensorDataset(x, y), batch_size=16, name="per_sample")  # fmt: skip
    with pytest.raises(TaskError) as failed:
        benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=2, window=1, auto=False)
    assert str(failed.value).startswith(
        "task.loss_fn(outputs, targets) returned a tensor of shape (16, 1); expected a scalar (one value for the batch)"
    )
