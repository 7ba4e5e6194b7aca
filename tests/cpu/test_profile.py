"""`redline profile` on small models on the CPU: a real torch.profiler trace read into phases and advice."""

import gzip
import json
import os
import time

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset
from typer.testing import CliRunner

import redline
from redline.bench.loops import phase
from redline.bench.profiling import _without_profiler_chatter
from redline.cli.main import app
from redline.errors import ConfigError, RedlineError, TrainingError


def small_task(**overrides) -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=gen), torch.randint(0, 4, (64,), generator=gen))
    fields = {
        "model": lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
        "loss_fn": nn.functional.cross_entropy,
        "train_data": data,
        "batch_size": 8,
        "name": "small",
    }
    return redline.Task(**{**fields, **overrides})


class SlowItems(Dataset):
    """Items that take 20 ms each to load: loading dominates any step of a small model."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        time.sleep(0.02)
        return self.base[i]


def test_a_profile_splits_the_step_into_its_phases_and_writes_the_trace(tmp_path):
    trace = tmp_path / "deep" / "trace.json.gz"
    wide = small_task(model=lambda: nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 4)))
    torch.manual_seed(1234)
    found = redline.profile(wide, devices="cpu", precision="fp32", compile=False, steps=3, warmup=1, trace=trace)
    drawn = torch.rand(3)  # the caller's stream goes on as it was: a notebook's later cells draw as without it
    torch.manual_seed(1234)
    assert torch.equal(drawn, torch.rand(3))
    assert found.breakdown.steps == 3 and found.breakdown.device_busy is None
    phases = {p.name: p for p in found.breakdown.phases}
    assert list(phases) == ["data", "forward", "backward", "optimizer", "other"]
    assert all(phases[name].host_ms > 0 for name in ("data", "forward", "backward", "optimizer"))
    assert sum(p.share for p in phases.values()) == pytest.approx(1.0, abs=0.01)
    assert found.ops and all(op.self_ms > 0 for op in found.ops)
    # the linear layers' work, by name (forward's addmm, backward's mm: on a busy machine one of them may be
    # preempted below the eighth op, not both)
    assert any(op.name in ("aten::addmm", "aten::mm") for op in found.ops)
    assert not any(op.name.startswith(("redline.", "ProfilerStep")) for op in found.ops)  # marks are not work
    assert found.plan.precision.value == "fp32" and found.setting == "cpu fp32 eager b8"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in events) == 3
    assert found.trace == str(trace)
    data = json.loads(json.dumps(found.to_dict()))  # --json prints it
    # each figure says what it is: whose clock the operators ran on, which peak, after how many warm-up steps
    assert (data["ops_on"], data["peak_memory_kind"], data["warmup"]) == ("host", "resident", 1)


def test_a_loss_that_is_not_finite_is_said_first_in_the_advice():
    # bench marks such a row "not finite"; profile gave its times as a healthy run's
    diverged = small_task(loss_fn=lambda out, y: nn.functional.cross_entropy(out, y) * float("nan"))
    found = redline.profile(diverged, devices="cpu", precision="fp32", compile=False, steps=1, warmup=1)
    assert found.advice[0].startswith("the loss is not finite (NaN or infinity) at the last recorded step")
    healthy = redline.profile(small_task(), devices="cpu", precision="fp32", compile=False, steps=1, warmup=1)
    assert not any("not finite" in line for line in healthy.advice)


def test_an_earlier_trace_is_replaced(tmp_path):
    trace = tmp_path / "trace.json.gz"
    trace.write_bytes(gzip.compress(b'{"schemaVersion": 1, "traceEvents": [{"name": "old"}]}'))
    redline.profile(small_task(), devices="cpu", precision="fp32", compile=False, steps=1, warmup=1, trace=trace)
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert {"name": "old"} not in events and any(e.get("name", "").startswith("ProfilerStep#") for e in events)


def test_a_stop_before_the_profile_is_done_leaves_the_earlier_trace_as_it_was(tmp_path, monkeypatch):
    """A Ctrl-C while the advice was drawn said "nothing was written" with the new trace already in place."""
    from redline.bench import profiling

    trace = tmp_path / "trace.json"
    trace.write_text('{"traceEvents": [{"name": "old"}]}')

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(profiling, "advise", interrupted)
    with pytest.raises(KeyboardInterrupt):
        redline.profile(small_task(), devices="cpu", precision="fp32", compile=False, steps=1, warmup=1, trace=trace)
    assert trace.read_text() == '{"traceEvents": [{"name": "old"}]}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


def test_a_refused_device_makes_no_folder_for_the_trace(tmp_path):
    with pytest.raises(RedlineError, match="cuda"):
        redline.profile(small_task(), devices="cuda", trace=tmp_path / "new" / "deep" / "t.json")
    assert list(tmp_path.iterdir()) == []


def test_slow_loading_is_found_and_the_advice_names_the_loader_flag():
    found = redline.profile(
        small_task(train_data=SlowItems(small_task().train_data), batch_size=4),
        devices="cpu", precision="fp32", compile=False, steps=2, warmup=1,
    )  # fmt: skip
    data = next(p for p in found.breakdown.phases if p.name == "data")
    assert data.share > 0.5  # 80 ms of loading against a step of well under a millisecond of arithmetic
    assert found.advice[0].startswith("loading: ") and "--loader-workers" in found.advice[0]


class FailsOnCall(nn.Module):
    """A model whose forward raises on its ``n``-th call, as a user's model with a bug in one branch does."""

    def __init__(self, n):
        super().__init__()
        self.n, self.calls, self.layer = n, 0, nn.Linear(16, 4)

    def forward(self, x):
        self.calls += 1
        if self.calls >= self.n:
            raise ValueError("mat1 and mat2 shapes cannot be multiplied")
        return self.layer(x)


@pytest.mark.parametrize(("n", "where"), [(1, "its model, loss or optimizer"), (3, "a recorded step")])
def test_a_task_whose_forward_raises_is_told_with_its_line_not_a_traceback(n, where):
    task = small_task(model=lambda: FailsOnCall(n))
    with pytest.raises(TrainingError) as raised:  # call 1 is the warm-up's, 2 the profiler's own, 3 recorded
        redline.profile(task, devices="cpu", precision="fp32", compile=False, steps=2, warmup=1)
    said = str(raised.value)
    assert said.startswith(f"profiling task 'small': {where} raised ValueError: mat1 and mat2 shapes cannot")
    assert f"at {__file__}:" in said and "in forward: raise ValueError(" in said
    assert "\nhint: check that the dataset's items are (inputs, targets)" in said
    assert isinstance(raised.value.__cause__, ValueError)


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(16, 4)

    def forward(self, x):
        return {"logits": self.layer(x)}


def test_a_loss_that_fails_inside_torch_is_not_pointed_at_a_line_the_error_does_not_show():
    with pytest.raises(TrainingError) as raised:  # cross_entropy given the model's dict: torch's frames, none of ours
        redline.profile(small_task(model=DictOut), devices="cpu", precision="fp32", compile=False, steps=1, warmup=1)
    said = str(raised.value)
    assert "raised TypeError: cross_entropy_loss(): argument 'input' (position 1) must be Tensor, not dict" in said
    assert "\n  at " not in said and "the line above" not in said
    assert "that loss_fn takes what the model returns; `redline train --task SPEC --max-steps 1` runs one" in said


def test_bad_arguments_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"expected a \.json or \.json\.gz file name.*\nhint: e\.g\. trace="):
        redline.profile(small_task(), devices="cpu", trace=tmp_path / "trace.txt")
    with pytest.raises(ConfigError, match=r"expected a file, not a directory\nhint: e\.g\. trace='.*trace\.json\.gz'"):
        redline.profile(small_task(), devices="cpu", trace=tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"expected a file in a directory; .*file is a file"):
        redline.profile(small_task(), devices="cpu", trace=tmp_path / "file" / "trace.json")
    summary = tmp_path / "run" / "summary.json"  # a run's own file: profile --trace replaced it with a trace
    summary.parent.mkdir()
    summary.write_text('{"task": "digits", "steps": 100}')
    for kept in (summary, tmp_path / "not-gzip.json.gz"):
        kept.write_bytes(kept.read_bytes() if kept.exists() else b"plain bytes")
        with pytest.raises(ConfigError, match=r"expected a new file, or an earlier Chrome trace to replace; this one"):
            redline.profile(small_task(), devices="cpu", trace=kept)
    assert summary.read_text() == '{"task": "digits", "steps": 100}'
    with pytest.raises(ConfigError, match=r"steps=0 is not allowed"):
        redline.profile(small_task(), devices="cpu", steps=0)
    with pytest.raises(Exception, match=r"fewer than the batch size 128"):
        redline.profile(small_task(), devices="cpu", batch_size=128)
    with pytest.raises(ConfigError, match=r"cuda_graphs='on' is not allowed; expected 'auto' or 'off' on cpu"):
        redline.profile(small_task(), devices="cpu", precision="fp32", cuda_graphs="on")


def test_a_profile_of_given_flags_leaves_cuda_graphs_to_auto_as_train_does():
    # it forced them off, "requested", where `redline train --precision fp32` leaves them to auto
    found = redline.profile(small_task(), devices="cpu", precision="fp32", steps=1, warmup=1)
    assert found.plan.cuda_graphs is not None and found.plan.cuda_graphs.reason.startswith("auto: CUDA graphs need")


def test_a_profile_with_graphs_off_is_an_explicit_eager_row():
    found = redline.profile(small_task(), devices="cpu", precision="fp32", cuda_graphs="off", steps=2, warmup=1)
    assert found.plan.cuda_graphs is not None and found.plan.cuda_graphs == redline.Choice(False, "requested")
    assert found.setting.startswith("cpu fp32 eager") and "CUDA graphs" not in found.setting
    # graphs off leave the compile to auto, as `redline train --cuda-graphs off` does (on a GPU auto may compile)
    assert found.plan.compile is not None and found.plan.compile.reason.startswith("auto"), found.plan.compile


def test_the_recorded_steps_last_until_the_device_is_done(monkeypatch):
    from redline.bench import profiling

    waits = []

    def slow_device(device):  # a GPU still running the steps the host queued: 30 ms of work left
        waits.append(device.type)
        time.sleep(0.03)

    monkeypatch.setattr(profiling, "_wait_for_device", slow_device)
    found = redline.profile(small_task(), devices="cpu", precision="fp32", compile=False, steps=3, warmup=1)
    assert waits == ["cpu", "cpu"]  # after the profiler's warm-up step, and at the end of the last recorded one
    assert found.breakdown.step_ms * 3 >= 30  # the wait for the device is part of the steps' time
    other = next(p for p in found.breakdown.phases if p.name == "other")
    assert other.host_ms * 3 >= 30  # outside the four phases: the step's end waiting for the device


def test_the_setting_names_what_the_plan_ran_not_auto():
    found = redline.profile(small_task(), devices="cpu", compile=False, steps=1, warmup=1)  # precision left to auto
    assert found.setting == f"cpu {found.plan.precision.value} eager b8"  # not "cpu auto eager b8"


def test_a_precision_left_to_auto_beside_a_given_compile_is_measured_as_redline_train_measures_it(
    bf16_measured_faster,
):
    long = redline.profile(small_task(), devices="cpu", compile=False, steps=1, warmup=1, planned_steps=10_000)
    assert long.plan.precision.value == "bf16-mixed"  # the rule keeps fp32 on a CPU
    assert long.plan.precision.reason.startswith("measured: bf16-mixed ran 1.43x fp32")
    assert long.setting == "cpu bf16-mixed eager b8"
    short = redline.profile(small_task(), devices="cpu", precision="auto", compile=False, steps=1, warmup=1)
    assert short.plan.precision.value == "bf16-mixed" and "cached from" in short.plan.precision.reason
    assert bf16_measured_faster == [["bf16-mixed"]]  # the short run recalled the measurement, as train's does


def test_a_process_without_stderr_is_profiled_all_the_same(monkeypatch):
    monkeypatch.setattr("sys.stderr", None)  # what Python sets when the process starts with stderr closed
    found = redline.profile(small_task(), devices="cpu", precision="fp32", compile=False, steps=1, warmup=1)
    assert found.breakdown.steps == 1


def test_phase_marks_cost_nothing_unless_a_profiler_records():
    assert type(phase("forward")).__name__ == "nullcontext"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert type(phase("forward")).__name__ != "nullcontext"


def test_the_profilers_own_start_and_stop_lines_are_dropped_and_anything_else_kept(capfd):
    with _without_profiler_chatter():
        os.write(2, b"USDT:2026-12-02 16:07:04 22082:22082 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning of the user's own\n")
    assert capfd.readouterr().err == "a warning of the user's own\n"


def test_the_cli_prints_the_phases_operators_and_advice(tmp_path):
    args = ["profile", "--task", "example:digits", "--devices", "cpu", "--precision", "fp32", "--compile", "off",
            "--steps", "2", "--warmup", "1", "--batch-size", "16"]  # fmt: skip
    shown = CliRunner().invoke(app, [*args, "--trace", str(tmp_path / "t.json")])
    assert shown.exit_code == 0, shown.output
    for said in ("Profile of digits (cpu fp32 eager b16): 2 steps recorded", "Phases of a step", "backward",
                 "Heaviest operators (host self time)", "advice: ", f"trace: {tmp_path / 't.json'}"):  # fmt: skip
        assert said in shown.output
    data = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert data["breakdown"]["steps"] == 2 and data["plan"]["precision"]["value"] == "fp32"
    listed = CliRunner().invoke(app, [*args, "--devices", "cpu,cuda"])  # as bench takes them
    assert str(listed.exception) == (
        "--devices='cpu,cuda' is not allowed; expected one device: 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'\n"
        "hint: profile one at a time, e.g. --devices 'cpu'"
    )
    unnamed = CliRunner().invoke(app, [*args, "--trace", str(tmp_path / "t.txt")])
    assert str(unnamed.exception).startswith(f"--trace='{tmp_path / 't.txt'}' is not allowed; expected a .json")
    bad = CliRunner().invoke(app, [*args, "--compile", "maybe"])
    assert isinstance(bad.exception, ConfigError)
    assert str(bad.exception).startswith("--compile='maybe' is not allowed; expected auto, on or off")


class Seen(RedlineError):
    """Raised in place of the warm-up: a redline error passes out of profile() unchanged."""


def stop_at_warm_up(monkeypatch) -> list:
    """Record the setting and options ``profile`` would warm up with, then stop: what runs is what this checks."""
    from redline.bench import profiling

    asked = []

    def recorded(task, setting, window, planned, seed, options=None):
        asked.append((setting, options))
        raise Seen

    monkeypatch.setattr(profiling, "warm_up", recorded)
    return asked


def test_a_compile_mode_is_profiled_as_asked_and_named_in_the_setting(monkeypatch):
    asked = stop_at_warm_up(monkeypatch)
    with pytest.raises(Seen):
        redline.profile(small_task(), devices="cpu", compile=True, compile_mode="reduce-overhead")
    ((setting, options),) = asked
    assert (options.compile, options.compile_mode, options.precision) == ("on", "reduce-overhead", "auto")
    assert setting.kind == "explicit" and setting.compile is True
    with pytest.raises(ConfigError, match=r"compile_mode='graphs' is not allowed.*'reduce-overhead'"):
        redline.profile(small_task(), devices="cpu", compile_mode="graphs")


def test_a_compile_mode_compiles_and_is_refused_with_compile_off(monkeypatch):
    asked = stop_at_warm_up(monkeypatch)
    with pytest.raises(Seen):  # auto would not compile on a CPU: the mode asked for a compiled step
        redline.profile(small_task(), devices="cpu", compile_mode="max-autotune")
    ((setting, options),) = asked
    assert (options.compile, options.compile_mode) == ("on", "max-autotune") and setting.compile is True
    refused = r"compile_mode='reduce-overhead' is not allowed; expected 'default' when compile is off"
    with pytest.raises(ConfigError, match=refused):
        redline.profile(small_task(), devices="cpu", compile=False, compile_mode="reduce-overhead")
    args = ["profile", "--task", "example:digits", "--devices", "cpu", "--compile", "off"]
    shown = CliRunner().invoke(app, [*args, "--compile-mode", "reduce-overhead"])
    assert str(shown.exception).startswith("--compile-mode='reduce-overhead' is not allowed; expected 'default'")
    hint = "\nhint: pass --compile 'on' to profile the step compiled in reduce-overhead, or --compile-mode 'default'"
    assert hint in str(shown.exception) and "compile_mode" not in str(shown.exception)  # flags, not Python's names
    assert len(asked) == 1  # refused before anything ran
    shown = CliRunner().invoke(app, ["profile", "--help"])
    assert "a mode other than default profiles the step compiled" in " ".join(shown.output.split())  # wrapped


def test_compile_given_as_a_word_is_read_as_the_word_says(monkeypatch):
    asked = stop_at_warm_up(monkeypatch)
    for word, compiles in (("off", False), ("on", True), ("auto", None)):
        with pytest.raises(Seen):
            redline.profile(small_task(), devices="cpu", compile=word)  # "off" is truthy: it must not compile
        assert asked.pop()[0].compile is compiles
    with pytest.raises(ConfigError, match=r"compile='maybe' is not allowed; expected True, False or None"):
        redline.profile(small_task(), devices="cpu", compile="maybe")


def test_auto_said_is_auto_left_out_what_redline_train_would_run(monkeypatch):
    asked = stop_at_warm_up(monkeypatch)
    for said in ({}, {"precision": "auto"}, {"compile": "auto"}, {"precision": "auto", "compile": None}):
        with pytest.raises(Seen):
            redline.profile(small_task(), devices="cpu", **said)
        setting, options = asked.pop()
        assert (setting.kind, setting.precision, setting.compile, options) == ("auto", "auto", None, None), said


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="auto picks the CPU here")
@pytest.mark.parametrize("given", [{}, {"precision": "fp32"}])
def test_a_profile_of_a_device_left_to_auto_says_why_auto_picked_it(given):
    # its Plan said "requested" of the CPU that auto picked, with or without flags; a device named stays "requested"
    left = redline.profile(small_task(), steps=1, warmup=1, **given)
    assert left.plan.device.reason.startswith("auto: no CUDA or MPS device visible"), left.plan.device
    named = redline.profile(small_task(), devices="cpu", steps=1, warmup=1, **given)
    assert named.plan.device.reason.startswith("requested"), named.plan.device
