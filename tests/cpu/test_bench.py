"""`redline bench` on small models on the CPU: every row measured, failures confined to their row, auto honest."""

import dataclasses
import json
import logging
import math
import os
import re
import signal
import time

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from dropped_interrupts import DropsItsInterrupt
from redline.bench import benchmark
from redline.bench import run as bench_run
from redline.bench.loops import Runner
from redline.bench.matrix import Setting
from redline.bench.run import BenchInterrupted, time_runners, warm_up
from redline.cli.bench import bench as bench_command
from redline.errors import ConfigError, TaskError
from redline.hardware.contention import Contention
from redline.hardware.device import DeviceFacts, probe_device
from redline.plan import Choice
from redline.plan.precision import resolve_precision
from redline.render.bench import bench_table
from redline.runtime import runtime as runtime_module
from redline.runtime.tuned import Candidate, Trial, TunedPlan, store_tuned
from redline.task import Task
from redline.train.config import TrainerConfig
from redline.train.data import plan_length
from redline.train.trainer import Trainer


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    # The slowed and the failing model have the same structure: a shared cache would hand one's trial to the other.
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "cache"))


class Slowed(nn.Module):
    """An MLP that, under CPU autocast, sleeps (``mode="slow"``) or fails as a missing kernel does (``"fail"``)."""

    def __init__(self, mode: str = "") -> None:
        super().__init__()
        self.mode = mode
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            if self.mode == "slow":
                time.sleep(0.02)  # a floor on the step's time, far above the ~0.1 ms the step itself takes
            elif self.mode == "fail":
                raise RuntimeError('"addmm_impl_cpu_" not implemented for this dtype (made up by the test)')
        return self.net(x)


def tiny_task(mode: str = "") -> Task:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 16, generator=generator), torch.randint(0, 4, (256,), generator=generator)
    return Task(
        model=lambda: Slowed(mode), loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x, y),
        batch_size=32, name="tiny",
    )  # fmt: skip


def test_every_row_is_measured_against_the_naive_loop():
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=12, window=2)
    assert [row.name for row in result.rows] == ["naive cpu fp32 b32", "cpu fp32 eager b32", "auto cpu b32"]
    assert result.steps == 12 and result.window == 2
    for row in result.rows:
        assert not row.error
        assert row.samples_per_s > 0 and row.tokens_per_s is None  # class labels, not tokens
        assert 0 < row.step_ms_p50 <= row.step_ms_p90
        assert math.isfinite(row.loss)
        assert row.tflops > 0 and row.mfu is None  # a CPU has no datasheet peak in the catalog
        assert row.mfu_measured > 0
        assert row.peak_mem_kind == "resident" and row.peak_mem_bytes > 0
        assert row.first_step_s > 0 and row.compile_s is None  # eager: the first step is all its one-off work
        assert row.speedup_naive == pytest.approx(row.samples_per_s / result.rows[0].samples_per_s)
    assert result.rows[0].speedup_naive == 1.0 and result.rows[0].plan is None
    assert result.rows[0].speedup_naive_interval is None  # the naive loop against itself
    for row in result.rows[1:]:  # six rounds: the lowest and highest of the rounds' ratios, which hold the medians'
        low, high = row.speedup_naive_interval
        assert 0 < low <= row.speedup_naive <= high
    auto = result.row("auto cpu b32")
    assert auto.plan["precision"]["value"] == auto.precision and auto.plan["compile"]["value"] is False
    # CUDA graphs left to auto, as `redline train` leaves them (the auto row had them off, "requested"), and an
    # explicit row's off, as asked
    assert auto.plan["cuda_graphs"]["reason"].startswith("auto: CUDA graphs need a CUDA device")
    assert result.row("cpu fp32 eager b32").plan["cuda_graphs"] == {"value": False, "reason": "requested"}
    json.dumps(result.to_dict(), allow_nan=False)  # strict JSON: what --json prints


class FailsOutsideAutocast(nn.Module):
    """Fails, once past its first ``after`` forward calls, where autocast is off: the naive loop's row fails in its
    timing while a bf16 row goes on."""

    def __init__(self, after: int = 6) -> None:
        super().__init__()
        self.after, self.calls = after, 0
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        self.calls += 1
        if self.calls > self.after and not torch.is_autocast_enabled("cpu"):
            raise RuntimeError("fp32 gave out (made up by the test)")
        return self.net(x)


def test_a_naive_loop_that_failed_in_its_timing_gives_the_others_no_interval_from_its_windows():
    task = dataclasses.replace(tiny_task(), model=FailsOutsideAutocast)
    result = benchmark(task, devices="cpu", precisions=["bf16-mixed"], compiles=[False], steps=16, window=2,
                       auto=False)  # fmt: skip
    naive, bf16 = result.rows
    assert "fp32 gave out" in naive.error and not bf16.error
    # the failed loop's later windows were no time at all: the interval read 0.00-0.59x against a null speed-up
    assert bf16.speedup_naive is None and bf16.speedup_naive_interval is None


class SizedStream(IterableDataset):
    """A stream that knows its length, as many do: a DataLoader refuses to shuffle it."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for i in range(128):
            yield torch.randn(16, generator=generator), torch.tensor(i % 4)

    def __len__(self) -> int:
        return 128


def test_a_stream_with_a_length_is_benched_in_its_own_order():
    task = dataclasses.replace(tiny_task(), train_data=SizedStream())
    result = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2)
    assert [row.error for row in result.rows] == ["", "", ""]
    assert all(row.samples_per_s > 0 for row in result.rows)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"precisions": "fp32"}, "precisions='fp32' is not allowed; expected a list"),
        ({"compiles": False}, "compiles=False is not allowed; expected a list"),
        ({"batch_sizes": 32}, "batch_sizes=32 is not allowed; expected a list"),
        # empty: the defaults ran unsaid (the command line refuses an empty --precision)
        ({"precisions": []}, r"precisions=\[\] is not allowed; expected a list of one or more"),
        ({"batch_sizes": []}, r"batch_sizes=\[\] is not allowed; expected a list of one or more"),
        ({"compiles": [], "auto": False}, r"compiles=\[\] is not allowed; expected a list of one or more"),
        ({"batch_sizes": [0]}, r"batch_sizes=\[0\] is not allowed; expected positive integers"),  # not CLI syntax
    ],
)
def test_a_lone_value_where_a_list_belongs_is_refused_before_anything_runs(given, message):
    with pytest.raises(ConfigError, match=rf"^{message}\nhint: e\.g\. "):
        benchmark(tiny_task(), **given)


@pytest.mark.parametrize("measure", ["benchmark", "profile", "tune"])
def test_a_seed_torch_does_not_take_is_refused_naming_it_not_blamed_on_the_task(measure):
    import redline

    # Runtime(seed=None) means "not set"; here each row failed with torch.manual_seed's TypeError, or profile
    # blamed the task's model, loss or optimizer for it.
    with pytest.raises(ConfigError, match=r"^seed=None is not allowed; expected an integer from "):
        getattr(redline, measure)(tiny_task(), devices="cpu", seed=None)


def test_a_batch_size_larger_than_the_data_is_refused_before_anything_runs():
    built: list[int] = []
    task = dataclasses.replace(tiny_task(), model=lambda: built.append(1) or Slowed())  # 256 samples
    with pytest.raises(
        TaskError, match=r"has 256 samples, fewer than the batch size 1000\nhint: pass batch sizes up to 256"
    ):
        benchmark(task, batch_sizes=[32, 1000], precisions=["fp32"], compiles=[False], auto=False, steps=1, window=1)
    assert built == []  # the batch-32 rows were not timed first, only to be lost


def test_a_compile_that_meets_the_models_bug_is_said_in_its_row_not_logged_by_torch():
    torch_log = logging.getLogger("torch._subclasses.fake_tensor")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    torch_log.addHandler(handler)
    task = dataclasses.replace(tiny_task(), model=lambda: nn.Linear(15, 4))  # the data has 16 features
    try:
        result = benchmark(task, precisions=["fp32"], compiles=[True], auto=False, steps=1, window=1)
    finally:
        torch_log.removeHandler(handler)
    assert [row.name for row in result.rows] == ["naive cpu fp32 b32", "cpu fp32 compiled b32"]
    assert all("mat1 and mat2 shapes cannot be multiplied" in row.error for row in result.rows)
    assert not records, [record.getMessage() for record in records]  # torch's traceback of the traced op


def test_a_slower_precision_shows_slower_and_auto_does_not_choose_it(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")  # plan as on a CPU with bf16 arithmetic, so auto weighs bf16
    result = benchmark(
        tiny_task("slow"), devices="cpu", precisions=["fp32", "bf16-mixed"], compiles=[False], steps=8, window=2,
        planned_steps=1000,  # long enough to repay auto's precision trial
    )  # fmt: skip
    fp32, bf16 = result.row("cpu fp32 eager b32"), result.row("cpu bf16-mixed eager b32")
    # The sleep is a lower bound on every bf16 step, whatever the machine's load; fp32's speed is not asserted.
    assert bf16.step_ms_p50 >= 20 and bf16.samples_per_s < fp32.samples_per_s
    auto = result.row("auto cpu b32")
    assert auto.precision == "fp32"
    assert auto.plan["precision"]["reason"].startswith("measured: fp32 kept")


def test_the_auto_row_of_a_run_too_short_to_repay_a_trial_keeps_the_rule_as_train_does(monkeypatch):
    # `make run` trained fp32 by the rule (too short to repay a trial), then benched an auto row that
    # measured bf16 and called it "what `redline train` runs".
    monkeypatch.setenv("REDLINE_CPU", "amx")
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2,
                       planned_steps=40)  # fmt: skip
    with Trainer(tiny_task(), TrainerConfig(max_steps=40, progress=False)) as trainer:
        trained = trainer.fit().plan.precision
    auto = result.row("auto cpu b32").plan["precision"]
    assert "not measured" in trained.reason and trained.reason.endswith("(--trial on measures anyway)")
    assert auto["value"] == trained.value
    # The same reason, but for the way to measure anyway (bench has no --trial flag), and the run's steps counted
    # toward its workload's later runs: a bench reads that count, and adds nothing to it.
    counted = "; this workload's next run here to bring them to 260, of 26 steps or more, measures"
    assert counted in trained.reason and counted not in auto["reason"]
    assert auto["reason"] == trained.reason.replace(counted, "").replace(
        "--trial on measures anyway", "--planned-steps with your run's length measures it where that repays it"
    )


def test_a_setting_that_fails_is_reported_in_its_row_and_the_others_run(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    result = benchmark(
        tiny_task("fail"), devices="cpu", precisions=["fp32", "bf16-mixed"], compiles=[False], steps=4, window=2,
        planned_steps=1000,
    )  # fmt: skip
    failed = result.row("cpu bf16-mixed eager b32")
    assert failed.error.startswith('RuntimeError: "addmm_impl_cpu_" not implemented')
    assert failed.samples_per_s is None and failed.speedup_naive is None
    assert not result.row("cpu fp32 eager b32").error
    auto = result.row("auto cpu b32")
    assert auto.precision == "fp32" and "bf16-mixed rejected: it failed" in auto.plan["precision"]["reason"]


class Flattens(nn.Module):
    """Flattens a convolution's output with ``view``, as old tutorials write: NHWC memory cannot be viewed so."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(64, 2)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).view(len(x), -1))


def test_a_row_whose_model_cannot_run_channels_last_runs_nchw_as_train_would_and_says_why(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")  # "auto" lays bf16 convolutions out NHWC on this CPU
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, 4, 4, generator=generator), torch.randint(0, 2, (64,), generator=generator))
    task = Task(model=Flattens, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=16, name="flattens")
    result = benchmark(task, devices="cpu", precisions=["bf16-mixed"], compiles=[False], steps=4, window=2)
    row = result.row("cpu bf16-mixed eager b16")
    assert not row.error and row.samples_per_s > 0
    layout = row.plan["channels_last"]
    assert layout["value"] is False
    assert "but the model's forward failed so (RuntimeError: view size is not compatible" in layout["reason"]


def test_a_precision_the_device_cannot_run_fails_its_rows_and_the_others_run(monkeypatch):
    # As bf16-mixed on a V100 (no native bf16): the Runtime refuses it for that device, not for the bench.
    real = runtime_module.resolve_precision

    def no_bf16(requested, facts):
        if requested == "bf16-mixed":
            raise ConfigError(
                "precision='bf16-mixed' was requested but Tesla V100 (compute capability 7.0) has no native bf16\n"
                "hint: use precision='fp16-mixed' (loss scaling is handled) or 'auto'"
            )
        return real(requested, facts)

    monkeypatch.setattr("redline.runtime.runtime.resolve_precision", no_bf16)
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32", "bf16-mixed"], compiles=[False], steps=2,
                       window=1, auto=False)  # fmt: skip
    refused = result.row("cpu bf16-mixed eager b32")
    assert refused.error.startswith("precision='bf16-mixed' was requested but Tesla V100"), refused.error
    assert "\nhint: use precision='fp16-mixed'" in refused.error  # the fix, as the Runtime gives it
    assert result.row("cpu fp32 eager b32").samples_per_s and result.row("naive cpu fp32 b32").samples_per_s


def test_two_batch_sizes_are_benched_and_compared_within_their_size():
    result = benchmark(
        tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], batch_sizes=[16, 64], steps=4, window=2,
        auto=False,
    )  # fmt: skip
    assert [row.name for row in result.rows] == [
        "naive cpu fp32 b16", "cpu fp32 eager b16", "naive cpu fp32 b64", "cpu fp32 eager b64",
    ]  # fmt: skip
    assert result.row("naive cpu fp32 b64").speedup_naive == 1.0


def test_the_estimate_is_asked_once_per_batch_precision_and_device_and_shown_on_each_row():
    asked = []

    def estimate(batch_size, precision, device_type):
        asked.append((batch_size, precision, device_type))
        return 1000 * batch_size

    result = benchmark(
        tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], batch_sizes=[16, 64], steps=4, window=2,
        auto=False, estimate=estimate,
    )  # fmt: skip
    assert asked == [(16, "fp32", "cpu"), (64, "fp32", "cpu")]
    assert {row.name: row.estimate_bytes for row in result.rows} == {
        "naive cpu fp32 b16": 16000, "cpu fp32 eager b16": 16000, "naive cpu fp32 b64": 64000,
        "cpu fp32 eager b64": 64000,
    }  # fmt: skip
    assert benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=2, window=2,
                     auto=False).rows[0].estimate_bytes is None  # fmt: skip


def test_the_matmul_a_row_is_measured_against_runs_with_its_own_tf32(monkeypatch):
    # The naive fp32 loop runs full fp32 matmuls; a Runtime fp32 row on a GPU turns TF32 on. Each row's
    # "of matmul" ratio must be over a matmul timed with its own setting, not the other's.
    real_plan = Runner.plan

    def plan_with_tf32(self):
        plan = real_plan(self)
        return None if plan is None else dataclasses.replace(plan, tf32=Choice(True, "on, as on a GPU"))

    peaks = iter([1.0, 4.0])  # TFLOP/s, far above what a tiny model achieves on a CPU
    monkeypatch.setattr(Runner, "plan", plan_with_tf32)
    monkeypatch.setattr("redline.runtime.cache.matmul_peak", lambda device, precision, blocks=5: next(peaks))
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2,
                       auto=False)  # fmt: skip
    naive, explicit = result.row("naive cpu fp32 b32"), result.row("cpu fp32 eager b32")
    assert naive.mfu_measured == pytest.approx(naive.tflops / 1.0)
    assert explicit.mfu_measured == pytest.approx(explicit.tflops / 4.0)


def test_a_bfloat16_model_in_fp32_rows_is_measured_against_a_bfloat16_matmul(monkeypatch):
    # A model trained as it is in bfloat16 runs bf16 matmuls under fp32: its "of matmul" ratio was over an fp32 one.
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 16, generator=generator).bfloat16(), torch.randint(0, 4, (256,), generator=generator)
    task = Task(model=lambda: nn.Linear(16, 4).bfloat16(), loss_fn=nn.functional.cross_entropy,
                train_data=TensorDataset(x, y), batch_size=32, name="bf16")  # fmt: skip
    asked: list[str] = []
    monkeypatch.setattr(
        "redline.runtime.cache.matmul_peak", lambda device, precision, blocks=5: asked.append(precision) or 4.0
    )
    result = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2, auto=False)
    assert all(not row.error for row in result.rows) and set(asked) == {"bf16-mixed"}


def test_a_row_that_outpaced_its_stalled_matmul_peak_gives_no_share(monkeypatch):
    monkeypatch.setattr("redline.runtime.cache.matmul_peak", lambda device, precision, blocks=5: 1e-9)  # stalled
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2,
                       auto=False)  # fmt: skip
    assert all(row.tflops > 1e-9 and row.mfu_measured is None for row in result.rows)


def test_windows_on_a_second_gpu_wait_for_that_gpu(monkeypatch):
    # torch.cuda.synchronize() with no argument waits for the current device (cuda:0) only.
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    batch = (torch.zeros(2, 1), torch.zeros(2, 1))
    runner = Runner(Setting("explicit", "cuda:1", "fp32", False, 2), nn.Linear(1, 1), lambda x, y: torch.zeros(()),
                    [batch])  # fmt: skip
    times = time_runners([runner], window=2, rounds=2, max_seconds=1.0)
    assert len(times[0][0]) == 2 and synced and all(torch.device(d) == torch.device("cuda:1") for d in synced)


def test_the_steps_reported_are_those_timed_when_max_seconds_stops_early():
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=20, window=2,
                       max_seconds=1e-9, auto=False)  # fmt: skip
    assert result.steps == 4  # two rounds of one window, not the ten rounds asked for
    assert result.steps_asked == 20 and result.stopped_early


def test_steps_that_are_not_whole_windows_are_rounded_up_and_the_bench_says_so(monkeypatch, capsys):
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=5, window=2,
                       auto=False)  # fmt: skip
    assert (result.steps, result.steps_asked, result.stopped_early) == (6, 5, False)
    monkeypatch.setattr("redline.cli.bench.benchmark", lambda *args, **kwargs: result)
    monkeypatch.setattr("redline.cli.bench._estimator", lambda *args: None)
    bench_command(task="example:digits", steps=5, window=2, estimate=False)
    out, err = capsys.readouterr()
    assert "note: --steps 5 times 6 steps per row: whole windows of 2 (--window), two at least" in " ".join(err.split())
    assert "Bench of tiny: 6 timed steps per row, in windows of 2 (5 asked, rounded up to whole windows" in " ".join(
        out.split()
    )


def test_a_ctrl_c_python_dropped_while_a_batch_size_ran_still_stops_the_bench_after_it(monkeypatch):
    monkeypatch.setattr("sys.unraisablehook", lambda unraisable: None)  # Python's "Exception ignored in", unsaid

    def dropped_at_16(task, setting, *args):
        if setting.batch_size == 16:
            DropsItsInterrupt(signal.SIGINT)  # a Ctrl-C inside a callback of torch's, which Python drops
        return warm_up(task, setting, *args)

    monkeypatch.setattr("redline.bench.run.warm_up", dropped_at_16)
    with pytest.raises(BenchInterrupted) as stopped:
        benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], batch_sizes=[16, 32], steps=2,
                  window=1, auto=False)  # fmt: skip
    assert stopped.value.exit_code == 130 and stopped.value.result.rows == ()  # batch 32 never ran


def test_a_ctrl_c_keeps_the_batch_sizes_finished_and_the_command_shows_them_then_exits_130(monkeypatch, capsys):
    def interrupted_at_32(task, setting, *args):
        if setting.batch_size == 32:
            raise KeyboardInterrupt  # Ctrl-C while the second batch size warms up
        return warm_up(task, setting, *args)

    monkeypatch.setattr("redline.bench.run.warm_up", interrupted_at_32)
    with pytest.raises(BenchInterrupted) as stopped:
        benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], batch_sizes=[16, 32], steps=2,
                  window=1, auto=False)  # fmt: skip
    result = stopped.value.result
    assert stopped.value.exit_code == 130 and [row.batch_size for row in result.rows] == [16, 16]
    assert str(stopped.value).startswith("bench interrupted (SIGINT) while warming up naive cpu fp32 b32 (batch 32)")

    def interrupted_bench(*args, **kwargs):
        raise stopped.value

    monkeypatch.setattr("redline.cli.bench.benchmark", interrupted_bench)
    with pytest.raises(BenchInterrupted):
        bench_command(task="example:digits", estimate=False)
    shown = " ".join(capsys.readouterr().out.split())
    assert "interrupted (SIGINT) while warming up naive cpu fp32 b32 (batch 32), so the batch sizes from it" in shown
    assert "fastest at batch 16" in shown


def test_a_ctrl_c_while_memory_is_estimated_after_the_timing_keeps_every_row_timed():
    # The estimates run after every batch size is timed, outside the loop that kept them: a Ctrl-C there lost
    # every row, and the command exited 130 without a word.
    def estimate(batch_size, precision, device):
        raise KeyboardInterrupt

    with pytest.raises(BenchInterrupted) as stopped:
        benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], batch_sizes=[16, 32], steps=2,
                  window=1, auto=False, estimate=estimate)  # fmt: skip
    result = stopped.value.result
    assert stopped.value.exit_code == 130 and [row.batch_size for row in result.rows] == [16, 16, 32, 32]
    assert all(row.estimate_bytes is None and row.samples_per_s for row in result.rows)
    assert str(stopped.value).startswith("bench interrupted (SIGINT) while estimating memory: every row was timed")
    from redline.render.bench import steps_told

    told = steps_told(result.to_dict())
    assert told.endswith("while estimating memory, so the estimates are missing"), "no batch size is missing"


def test_a_task_name_with_brackets_is_shown_as_written_not_read_as_markup():
    """`name=x[/]` ended the bench, every row timed, in rich's MarkupError: no table, no page."""
    from rich.console import Console

    from redline.render.bench import bench_table

    task = dataclasses.replace(tiny_task(), name="x[/] and gpt[small]")
    result = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], batch_sizes=[16], steps=2,
                       window=1, auto=False)  # fmt: skip
    console = Console(width=200, record=True)
    console.print(bench_table(result.to_dict()))
    assert "Bench of x[/] and gpt[small]:" in console.export_text()


def test_a_ctrl_c_before_the_first_row_warms_up_says_the_bench_was_setting_up(monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt  # Ctrl-C before any row is told to warm up (it said "while  (batch 16)")

    monkeypatch.setattr("redline.bench.run._warm_up_all", interrupted)
    with pytest.raises(BenchInterrupted) as stopped:
        benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], batch_sizes=[16], steps=2,
                  window=1, auto=False)  # fmt: skip
    assert str(stopped.value).startswith("bench interrupted (SIGINT) while setting up (batch 16)")


def test_a_sigterm_keeps_the_batch_sizes_finished_as_a_ctrl_c_does_and_exits_143(monkeypatch, capsys):
    def not_taken(signum, frame):
        raise AssertionError("the command line did not take SIGTERM")  # instead of the test process ending

    def terminated_at_32(task, setting, *args):
        if setting.batch_size == 32:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's, while the second batch size warms up
            time.sleep(10)  # its handler raises in here
        return warm_up(task, setting, *args)

    monkeypatch.setattr("redline.bench.run.warm_up", terminated_at_32)
    before = signal.signal(signal.SIGTERM, not_taken)
    try:
        with pytest.raises(BenchInterrupted) as stopped:
            bench_command(task="example:digits", devices="cpu", precision="fp32", compile="off", batch_size="16,32",
                          steps=2, window=1, auto=False, estimate=False)  # fmt: skip
        assert signal.getsignal(signal.SIGTERM) is not_taken  # given back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stopped.value.exit_code == 143
    assert str(stopped.value).startswith("bench interrupted (SIGTERM) while warming up naive cpu fp32 b32 (batch 32)")
    shown = " ".join(capsys.readouterr().out.split())
    assert "fastest at batch 16" in shown


def test_the_auto_rows_peak_memory_is_its_own_not_its_precision_trials(monkeypatch):
    # auto's trial trains copies of the model before the row is built; what they held is not the row's peak.
    def trial_holding_memory(*args, **kwargs):
        held = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        time.sleep(0.05)  # long enough for the resident-set sampler to see it
        del held
        return {}

    monkeypatch.setattr("redline.bench.run.measure_auto", trial_holding_memory)
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=2, window=2)
    naive, auto = result.row("naive cpu fp32 b32"), result.row("auto cpu b32")
    assert auto.peak_mem_bytes < naive.peak_mem_bytes + 32 * 2**20


def test_a_precision_the_tuned_plan_left_to_auto_is_measured_in_the_auto_row_as_train_does(monkeypatch):
    # A tune whose budget ran out before precision left it to the run's auto: train then measured it, while the
    # auto row took the rule's fp32 (on an AMX CPU, where the trial picks bf16 for digits).
    monkeypatch.setenv("REDLINE_CPU", "amx")
    task = tiny_task()
    tuned = TunedPlan(
        task=task.name, device="cpu", batch_size=32, planned_steps=500, measured_at="2026-12-01 06:00 UTC",
        best=Candidate(precision="fp32"), reasons={"precision": "not measured: the budget was spent; left to auto"},
        trials=(Trial(Candidate(), 0.002),), unmeasured=("precision",),
    )  # fmt: skip
    store_tuned(task.fingerprint(), probe_device(torch.device("cpu")), tuned)
    asked = []

    def measured_bf16(task, options, batch_size, planned, env, **_):
        asked.append((options.precision, batch_size))
        return {"precision": Choice("bf16-mixed", "measured: bf16-mixed ran 1.70x fp32 (made up)")}

    monkeypatch.setattr("redline.bench.run.measure_auto", measured_bf16)
    result = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2)
    auto = result.row("auto cpu b32")
    assert ("auto", 32) in asked
    assert auto.precision == "bf16-mixed" and auto.plan["precision"]["reason"].startswith("measured: bf16-mixed")


def cache_two_micro_batches(task: Task) -> None:
    """Cache a made-up tune of ``task`` at batch 32 for 8 steps: fp32, two micro-batches a step."""
    tuned = TunedPlan(
        task=task.name, device="cpu", batch_size=32, planned_steps=8, measured_at="2026-12-01 06:00 UTC",
        best=Candidate(precision="fp32", grad_accum=2),
        reasons={"grad_accum": "2 micro-batches per step, 1.20x less time for 8 steps (made up)"},
        trials=(Trial(Candidate(), 0.002),),
    )  # fmt: skip
    store_tuned(task.fingerprint(), probe_device(torch.device("cpu")), tuned)


def test_the_auto_row_runs_a_cached_tuned_plan_as_train_does():
    # After `redline tune`, `redline train` runs the tuned Plan: the auto row shows that run, not auto's rules.
    task = tiny_task()
    cache_two_micro_batches(task)  # weighed for the task's own run: 8 steps of 32 of its 256 samples
    result = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2)
    auto, eager = result.row("auto cpu b32"), result.row("cpu fp32 eager b32")
    assert not auto.error and auto.precision == "fp32"
    assert auto.plan["grad_accum"]["value"] == 2 and eager.plan["grad_accum"]["value"] == 1
    assert auto.plan["grad_accum"]["reason"].startswith("tuned 2026-12-01 06:00 UTC for 8 steps")
    trained = Trainer(task, TrainerConfig(max_steps=4, progress=False)).fit().plan.to_dict()
    for axis in ("precision", "compile", "grad_accum"):
        assert auto.plan[axis] == trained[axis]
    # a step is still the row's batch of 32, as two micro-batches of 16: the FLOPs per sample are the eager row's
    assert auto.tflops / auto.samples_per_s == pytest.approx(eager.tflops / eager.samples_per_s)
    # a run of another length (--planned-steps 100) leaves the tune to auto's rules, as train does
    longer = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2, planned_steps=100)
    assert longer.row("auto cpu b32").plan["grad_accum"]["value"] == 1


def test_the_auto_row_leaves_out_a_tuned_micro_batching_that_train_leaves_out(caplog):
    # 240 samples in micro-batches of 16 make 15 an epoch: 7 steps, the last one untrained, so `redline train` ran
    # whole batches; the auto row ran the tune's two micro-batches, labelled "what `redline train` runs". A longer
    # run steps the epoch's last micro-batch with the next epoch's first, where whole batches step it alone.
    x, y = tiny_task().train_data.tensors
    task = dataclasses.replace(tiny_task(), train_data=TensorDataset(x[:240], y[:240]))
    cache_two_micro_batches(task)  # weighed for the task's own run: 8 batches of 32
    with caplog.at_level(logging.INFO, logger="redline"):
        result = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2)
    auto = result.row("auto cpu b32")
    assert not auto.error and auto.plan["grad_accum"]["value"] == 1
    told = "not taken: an epoch of 240 samples ends in a batch of 16, not 32"
    assert told in auto.plan["grad_accum"]["reason"] and told in caplog.text
    trained = Trainer(task, TrainerConfig(progress=False)).fit().plan.to_dict()
    assert auto.plan["grad_accum"] == trained["grad_accum"]
    # a run of 16 steps (--planned-steps 16, as `train --max-steps 16`) goes on past the epoch: refused alike
    longer = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2, planned_steps=16)
    assert longer.row("auto cpu b32").plan["grad_accum"]["value"] == 1
    assert told in longer.row("auto cpu b32").plan["grad_accum"]["reason"]
    # 7 steps (as `train --max-steps 7`) end before the partial batch: they take them
    shorter = benchmark(task, devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2, planned_steps=7)
    assert shorter.row("auto cpu b32").plan["grad_accum"]["value"] == 2


@pytest.mark.slow
def test_each_compiled_row_shows_the_compile_a_fresh_run_pays(monkeypatch):
    # torch.compile's cache is process-wide: a model of the same structure compiled before (an earlier
    # bench, or another row with the same graph) would make a row's compile look free.
    from redline.plan import compile as plan_compile

    real = plan_compile.resolve_compile
    monkeypatch.setenv("REDLINE_CPU", "avx2")  # auto keeps fp32 (no bf16 trial), the compiled row's graph
    monkeypatch.setattr(  # auto compiles here, as it does on a GPU for a long run
        "redline.runtime.compile.resolve_compile",
        lambda requested, *a, **k: Choice(True, "auto (test)") if requested == "auto" else real(requested, *a, **k),
    )
    monkeypatch.setattr("redline.runtime.compile_check.LEAST_COMPILE_S", 0.0)  # a run long enough to try compiling
    monkeypatch.setattr("redline.runtime.compile_check.KEEP", 0.0)  # and its check keeps the compile, faster or not
    for again in (False, True):
        result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[True], steps=2, window=2)
        compiled, auto = result.row("cpu fp32 compiled b32"), result.row("auto cpu b32")
        assert auto.compile and compiled.compile_s > 0 and auto.compile_s == compiled.compile_s
        # torch's on-disk caches outlive the in-process one: the second bench's compile was served from them, and
        # says so (the first's was too where an earlier process compiled this graph), as torch's counters tell
        assert compiled.compile_cached in ((True,) if again else (True, False)) and auto.compile_cached is not None
        assert auto.compile_cached == compiled.compile_cached


@pytest.mark.slow
def test_a_compile_the_auto_rows_check_paid_and_then_dropped_for_eager_shows_its_seconds(monkeypatch):
    # The check compiled the model, found it no faster and kept eager: the row's compile_s was None (it had not
    # compiled), so the seconds the run paid for the compile never showed.
    from redline.plan import compile as plan_compile

    real = plan_compile.resolve_compile
    monkeypatch.setenv("REDLINE_CPU", "avx2")  # auto keeps fp32: no trial
    monkeypatch.setattr(  # auto compiles here, as it does on a GPU for a long run
        "redline.runtime.compile.resolve_compile",
        lambda requested, *a, **k: Choice(True, "auto (test)") if requested == "auto" else real(requested, *a, **k),
    )
    monkeypatch.setattr("redline.runtime.compile_check.LEAST_COMPILE_S", 0.0)  # a run long enough to try compiling
    monkeypatch.setattr("redline.runtime.compile_check.KEEP", math.inf)  # and its check keeps eager, whatever it saw
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=2, window=2)
    auto, eager = result.row("auto cpu b32"), result.row("cpu fp32 eager b32")
    assert auto.compile is False and auto.compile_s > 0 and auto.break_even_steps is None
    assert eager.compile_s is None and eager.compile_cached is None  # nothing compiled there
    line = next(line for line in bench_table_text(result.to_dict()).splitlines() if line.startswith("auto cpu"))
    assert re.search(rf" {auto.compile_s:.1f}\*?/kept eager ", line)  # the HTML's repaid steps cell says it too
    assert len({row.loss_step for row in result.rows}) == 1  # the 35 steps of its check: every row caught up


@pytest.mark.slow
def test_cli_bench_json_and_html_with_a_compiled_row(tmp_path, redline_here):
    page = tmp_path / "bench.html"
    result = redline_here(
        "bench", "--task", "example:digits", "--precision", "fp32", "--compile", "off,on", "--steps", "4",
        "--window", "2", "--no-auto", "--json", "--html", str(page),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    html = page.read_text()
    assert "<title>redline bench: digits, " in html
    assert all(row["name"] in html for row in data["rows"]) and html.count("data:image/png;base64,") >= 2
    rows = {row["name"]: row for row in data["rows"]}
    assert list(rows) == ["naive cpu fp32 b64", "cpu fp32 eager b64", "cpu fp32 compiled b64"]
    compiled = rows["cpu fp32 compiled b64"]
    assert compiled["compile"] is True and compiled["compile_s"] > 0
    eager = rows["cpu fp32 eager b64"]
    if compiled["step_ms_p50"] < eager["step_ms_p50"]:  # which is faster varies by CPU; the arithmetic does not
        saved = (eager["step_ms_p50"] - compiled["step_ms_p50"]) / 1e3
        assert compiled["break_even_steps"] == pytest.approx(compiled["compile_s"] / saved)
    else:
        assert compiled["break_even_steps"] is None
    assert "compiled" in compiled["plan"]["compile"]["reason"]
    # beside each row's measured peak, the step's predicted one, the same for every row of one precision
    assert len({row["estimate_bytes"] for row in data["rows"]}) == 1 and eager["estimate_bytes"] > 2**20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--compile", "maybe"], "hint: e.g. --compile off,on"),
        (["--batch-size", "0"], "hint: e.g. --batch-size 32,64"),
        (["--precision", "fp32,bf16"], "hint: did you mean bf16-mixed?"),
        (["--precision", "fp8"], "hint: e.g. --precision fp32,bf16-mixed"),
        (["--precision", "fp32,auto"], "hint: auto's choice is the auto row's, benched unless --no-auto; list fixed"),
        (["--devices", "cuda:7"], "hint:"),
    ],
)
def test_cli_bench_refuses_bad_flags_with_a_hint(args, message, redline_here):
    result = redline_here("bench", "--task", "example:digits", *args)
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_bench_takes_precisions_in_any_case_as_it_takes_compile_on(monkeypatch):
    asked = {}

    def benchmark_seen(task, **kwargs):
        asked.update(kwargs)
        raise KeyboardInterrupt  # enough: the flags were read

    monkeypatch.setattr("redline.cli.bench.benchmark", benchmark_seen)
    with pytest.raises(KeyboardInterrupt):
        bench_command(task="example:digits", precision="FP32,BF16-mixed", compile="ON", estimate=False)
    assert asked["precisions"] == ["fp32", "bf16-mixed"] and asked["compiles"] == [True]


def test_cli_bench_refuses_planned_steps_without_the_auto_row_it_decides_for(monkeypatch):
    monkeypatch.setattr("redline.cli.bench.benchmark", lambda *args, **kwargs: pytest.fail("the bench ran"))
    expected = "--planned-steps=100 is not allowed; expected only with the auto row\nhint: --planned-steps decides"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        bench_command(task="example:digits", planned_steps=100, auto=False)


@pytest.mark.parametrize("given", ["cpu,", ",", " "])
def test_cli_bench_names_a_device_list_with_a_blank_by_its_flag(given, monkeypatch):
    monkeypatch.setattr("redline.bench.run.expand", lambda *args, **kwargs: pytest.fail("the bench ran"))
    expected = f"--devices={given!r} is not allowed; expected device names separated by commas\n"
    expected += "hint: e.g. --devices 'cpu,cuda'"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        bench_command(task="example:digits", devices=given)


@pytest.mark.parametrize("given", ["", ","])
def test_cli_bench_names_an_empty_compile_by_its_own_flag(given, monkeypatch):
    def no_bench(*args, **kwargs):
        raise AssertionError("the bench ran on an empty --compile")

    monkeypatch.setattr("redline.cli.bench.benchmark", no_bench)
    with pytest.raises(ConfigError, match=f"--compile {given!r}: expected on and/or off\nhint: e.g. --compile off,on"):
        bench_command(task="example:digits", compile=given)


@pytest.mark.parametrize(
    ("flag", "given", "example"),
    [("precision", "fp32,", "fp32,bf16-mixed"), ("batch_size", "16,", "32,64"), ("compile", "off,,on", "off,on")],
)
def test_cli_bench_refuses_a_blank_item_in_any_list_as_devices_does(flag, given, example, monkeypatch):
    monkeypatch.setattr("redline.cli.bench.benchmark", lambda *args, **kwargs: pytest.fail("the bench ran"))
    name = "--" + flag.replace("_", "-")
    expected = f"{name} {given!r} has an empty item between commas\nhint: e.g. {name} {example}"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        bench_command(task="example:digits", **{flag: given})


def test_cli_bench_checks_where_the_html_goes_before_it_spends_the_bench(tmp_path, monkeypatch):
    def no_bench(*args, **kwargs):
        raise AssertionError("the bench ran, and its result would be lost when the page cannot be written")

    monkeypatch.setattr("redline.cli.bench.benchmark", no_bench)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match=r"is in '.*notes\.txt', which is a file, not a directory\nhint: pass a file"):
        bench_command(task="example:digits", html=tmp_path / "notes.txt" / "runs" / "bench.html")
    with pytest.raises(ConfigError, match=r"'.*' is a directory\nhint: name a file, e\.g\. .*bench\.html"):
        bench_command(task="example:digits", html=tmp_path)


def test_cli_bench_writes_its_html_page_into_a_directory_it_creates(tmp_path, capsys):
    page = tmp_path / "reports" / "today" / "bench.html"  # as `redline train --out` creates its directory
    bench_command(task="example:digits", devices="cpu", precision="fp32", compile="off", auto=False, steps=2,
                  window=1, estimate=False, html=page)  # fmt: skip
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert f"report: {page}" in capsys.readouterr().out


def test_cli_bench_refuses_an_html_page_in_a_read_only_directory_before_it_spends_the_bench(tmp_path, monkeypatch):
    def no_bench(*args, **kwargs):
        raise AssertionError("the bench ran, and its result would be lost when the page cannot be written")

    def read_only(*args, **kwargs):  # what creating a file in a read-only directory raises (root would pass)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("redline.cli.bench.benchmark", no_bench)
    monkeypatch.setattr("redline.atomic._temporary_beside", read_only)
    page = tmp_path / "bench.html"
    with pytest.raises(ConfigError, match=r"cannot be written \(Permission denied\)\nhint: pass a file in a directory"):
        bench_command(task="example:digits", html=page)


def test_a_row_refused_by_its_device_says_the_fix_by_the_cli_flag(monkeypatch, capsys):
    # bf16 on a V100 (no native bf16): the row's error is the precision resolver's, whose hint speaks Python.
    v100 = DeviceFacts(type="cuda", name="Tesla V100-SXM2-16GB", index=0, capability=(7, 0))
    real = bench_run.warm_up

    def on_a_v100(task, setting, *args):
        if setting.precision == "bf16-mixed":
            resolve_precision("bf16-mixed", v100)
        return real(task, setting, *args)

    monkeypatch.setattr(bench_run, "warm_up", on_a_v100)
    bench_command(task="example:digits", devices="cpu", precision="fp32,bf16-mixed", compile="off", auto=False,
                  steps=2, window=1, estimate=False, json_output=True)  # fmt: skip
    failed = next(row for row in json.loads(capsys.readouterr().out)["rows"] if row["error"])
    assert failed["name"] == "cpu bf16-mixed eager b64"
    assert failed["error"].startswith("--precision='bf16-mixed' is not allowed; expected 'fp32', 'fp16-mixed'")
    assert failed["error"].endswith("\nhint: use --precision 'fp16-mixed' (loss scaling is handled) or 'auto'")


def test_a_compiled_row_whose_compile_fell_back_is_a_failed_row_not_the_fastest(broken_compiler):
    """With the compiler broken, the row named "cpu fp32 compiled" ran the eager model, and was named the fastest."""
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False, True], batch_sizes=[16],
                       steps=2, window=1, auto=False)  # fmt: skip
    rows = {row.name: row for row in result.rows}
    eager, compiled = rows["cpu fp32 eager b16"], rows["cpu fp32 compiled b16"]
    assert eager.error == "" and eager.samples_per_s
    assert compiled.error.startswith("torch.compile fell back to eager, so it would time the eager model")
    assert "backend exploded" in compiled.error and compiled.samples_per_s is None


def test_torch_compiles_start_up_is_paid_once_before_the_first_compiled_row(monkeypatch):
    """The first compiled row paid the process's compiler start-up (1.47 s against 0.11 s for the next, in either
    order), and its break-even with it: every compiled row is now charged alike."""
    from redline.bench import compile_cache

    compiled = []
    real = torch.compile
    monkeypatch.setattr(compile_cache, "_STARTED", set())
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compiled.append(fn) or real(fn, **options))
    compile_cache.reset_compiler(["cpu"])
    compile_cache.reset_compiler(["cpu"])
    assert compiled == [compile_cache._doubled], "once a process and device, before the cache is cleared"
    compile_cache.reset_compiler()
    assert compiled == [compile_cache._doubled], "no compiled row, no start-up"


def test_a_row_on_a_tuned_plan_of_micro_batches_is_estimated_at_its_micro_batch():
    """A tuned Plan of 2 micro-batches ran batches of 16 in an auto row of 32, estimated at 32: the bf16 eager row's."""
    from redline.bench.result import BenchRow
    from redline.bench.run import _with_estimates

    split = {"grad_accum": {"value": 2, "reason": "tuned ... 2 micro-batches per step"}}
    rows = [
        BenchRow("auto cpu b32", "auto", "cpu", "bf16-mixed", False, None, 32, samples_per_s=1.0, plan=split),
        BenchRow("cpu bf16-mixed eager b32", "explicit", "cpu", "bf16-mixed", False, None, 32, samples_per_s=1.0),
    ]
    estimated = _with_estimates(rows, lambda batch, precision, device: 1000 * batch)
    assert [row.estimate_bytes for row in estimated] == [16_000, 32_000]


def test_a_bench_leaves_the_callers_random_streams_as_they_were():
    # Each row seeds torch with the bench's seed: after a bench, torch drew the same numbers whatever the caller seeded.
    drawn = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=2, window=1, auto=False)
        after = torch.rand(3)
        torch.manual_seed(seed)
        assert torch.equal(after, torch.rand(3))  # as if no bench had run
        drawn.append(after)
    assert not torch.equal(*drawn)


def test_a_compiled_row_whose_calls_ran_eagerly_past_the_recompile_limit_is_not_timed_as_compiled():
    # The Plan says compiled (it did, once), yet torch skipped the forward from its give-up on: the row timed eager.
    from types import SimpleNamespace

    import torch._dynamo.config as dynamo_config

    from redline.bench.loops import ran_eagerly
    from redline.runtime.compile import compile_module

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    with dynamo_config.patch(name, 1):
        record = compile_module(nn.Sequential(nn.ReLU()), backend="eager", dynamic=False)
        for rows in (1, 2, 2):
            record.module(torch.zeros(rows))
    plan = SimpleNamespace(compile=Choice(True, "requested; compiled 1 time(s)"), cuda_graphs=None)
    runner = SimpleNamespace(model=record.module, runtime=None, plan=lambda: plan)
    assert ran_eagerly(runner, compiled=True).endswith("2 of 3 call(s) ran eagerly, so it would time the eager model")
    assert ran_eagerly(runner, compiled=False) == ""


def test_the_auto_rows_precision_trial_is_timed_and_recorded_on_its_row(monkeypatch):
    # "compile included" charged compiled rows their compile, not the auto row its trial: it ran unrecorded.
    def slow_trial(task, options, batch_size, planned, env, **_):
        if options.precision != "auto":
            return {}  # a precision given: nothing to measure
        time.sleep(0.3)
        return {"precision": Choice("fp32", "measured: fp32 ran 1.10x bf16-mixed (made up)")}

    monkeypatch.setattr("redline.bench.run.measure_auto", slow_trial)
    monkeypatch.setenv("REDLINE_CPU", "amx")  # a CPU with bf16 arithmetic: auto's precision is measured
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2)
    auto, eager = result.row("auto cpu b32"), result.row("cpu fp32 eager b32")
    assert auto.trial_s >= 0.3 and auto.trial_cached is False
    assert eager.trial_s is None and result.row("naive cpu fp32 b32").trial_s is None
    assert result.to_dict()["rows"][-1]["trial_s"] == auto.trial_s


def test_a_trial_read_from_redlines_cache_is_marked_cached_and_a_run_too_short_has_none(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    read = {"precision": Choice("fp32", "measured: fp32 ran 1.10x bf16-mixed; cached from 2026-12-01 06:00 UTC")}
    monkeypatch.setattr(
        "redline.bench.run.measure_auto", lambda task, options, *a, **k: read if options.precision == "auto" else {}
    )
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2)
    assert result.row("auto cpu b32").trial_cached is True
    monkeypatch.undo()
    monkeypatch.setenv("REDLINE_CACHE_DIR", os.environ["REDLINE_CACHE_DIR"] + "-short")
    monkeypatch.setenv("REDLINE_CPU", "amx")
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2,
                       planned_steps=40)  # fmt: skip  # too short to repay a trial: none ran, none is charged
    auto = result.row("auto cpu b32")
    assert "not measured" in auto.plan["precision"]["reason"] and auto.trial_s is None and auto.trial_cached is None


def test_a_runtime_fp32_row_with_tf32_on_is_labelled_so_and_the_naive_loop_is_not(monkeypatch):
    # On an Ampere GPU every Runtime fp32 row runs TF32 while the naive loop runs true fp32; both read "fp32".
    real_plan = Runner.plan

    def plan_with_tf32(self):
        plan = real_plan(self)
        return None if plan is None else dataclasses.replace(plan, tf32=Choice(True, "on, as on a GPU"))

    monkeypatch.setattr(Runner, "plan", plan_with_tf32)
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2)
    rows = {row["name"]: row for row in result.to_dict()["rows"]}
    assert rows["cpu fp32 eager b32"]["plan"]["tf32"]["value"] is True  # in the JSON, where a reader finds it
    shown = " ".join(bench_table_text(result.to_dict()).split())
    assert "cpu fp32 (TF32) eager b32" in shown and "naive cpu fp32 b32" in shown
    assert "naive cpu fp32 (TF32)" not in shown and "fp32 (TF32): the row's fp32 matmuls ran in TF32" in shown


def bench_table_text(result: dict) -> str:
    from rich.console import Console

    from redline.render.bench import bench_table, best_line

    console = Console(width=300, record=True)
    console.print(bench_table(result))
    console.print(best_line(result))
    return console.export_text()


@pytest.mark.parametrize(("items", "batch_size", "steps"), [(256, 32, 24), (250, 32, 24), (10, 32, 3), (1438, 64, 69)])
def test_the_task_run_bench_and_tune_plan_for_is_the_one_train_plans(items, batch_size, steps):
    # digits' 1,438 items in batches of 64 over 15 epochs: train runs 345 steps, a partial batch an epoch included;
    # bench and tune counted full batches only (330) and measured auto's trial for a shorter run than train's
    data = TensorDataset(torch.zeros(items, 2), torch.zeros(items, dtype=torch.long))
    task = Task(model=lambda: nn.Linear(2, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                batch_size=batch_size, epochs=3)  # fmt: skip
    planned, _ = plan_length(data, batch_size=batch_size, world_size=1, grad_accum=1, max_epochs=3, max_steps=None)
    assert bench_run.task_steps(task, batch_size) == planned == steps


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="auto picks the CPU here")
def test_the_auto_row_of_a_device_left_to_auto_says_why_auto_picked_it_as_train_does():
    # its Plan said "requested" of the CPU that auto picked; a device the user named stays "requested"
    kept = {"precisions": ["fp32"], "compiles": [False], "steps": 4, "window": 2}
    left = benchmark(tiny_task(), **kept)
    assert left.row("auto cpu b32").plan["device"]["reason"].startswith("auto: no CUDA or MPS device visible")
    assert left.row("cpu fp32 eager b32").plan["device"]["reason"].startswith("requested")
    named = benchmark(tiny_task(), devices="cpu", **kept)
    assert named.row("auto cpu b32").plan["device"]["reason"].startswith("requested")


def test_a_bench_on_cpus_other_work_kept_busy_says_so_in_its_title_and_json(monkeypatch):
    class Busy:  # the machine as hardware/contention.py would read it with three other processes running
        def start(self):
            return self

        def stop(self, threads):
            return Contention(others=1.63, cpus=2, threads=2)

    monkeypatch.setattr(bench_run, "Sampler", Busy)
    result = benchmark(tiny_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=2, window=1, auto=False)
    assert result.machine["others_cpus"] == 1.63 and result.machine["busy"] is True
    data = json.loads(json.dumps(result.to_dict()))
    assert data["machine"]["busy"] is True
    told = bench_table(data).title.plain
    assert "; other processes kept 1.63 CPUs busy meanwhile, fewer free than the rows' threads need" in told
    quiet = dataclasses.replace(result, machine={**result.machine, "others_cpus": 0.02, "busy": False})
    assert "other processes" not in bench_table(quiet.to_dict()).title.plain
