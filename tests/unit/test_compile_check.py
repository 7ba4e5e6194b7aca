"""An automatic compile is confirmed on the run's own first steps, and dropped where the compiled steps are slower."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline.runtime.compile as compile_home
from redline.bench.matrix import Setting
from redline.bench.run import warm_up
from redline.plan import Choice
from redline.runtime.compile import CompileRecord
from redline.runtime.compile_check import EAGER_END, STEPS, CompileCheck
from redline.runtime.runtime import Runtime
from redline.runtime.stopwatch import StepTimer, Stopwatch
from redline.task import Task

PLANNED = Choice(True, "auto: 5000 steps on NVIDIA H100 repay the compile time")


def fake_compiled(model: nn.Module, pause: float = 0.0) -> CompileRecord:
    """Install a stand-in for a compiled forward on ``model`` (calls counted, ``pause`` seconds each) and return
    its record, as compile_module would."""
    eager = model.forward

    def compiled(*args, **kwargs):
        compiled.calls += 1
        time.sleep(pause)
        return eager(*args, **kwargs)

    compiled.calls = 0
    model.forward = compiled
    return CompileRecord(module=model, eager=eager, seconds=4.0, compiles=1, training=1)


def drive(
    eager_ms: float, compiled_ms: float, steps: int = STEPS, planned: int = 100_000
) -> tuple[CompileCheck, CompileRecord, list[str]]:
    """Run a check for ``steps`` steps on a fake clock: each step takes what the model's current forward costs."""
    model = nn.Linear(2, 2)
    record = fake_compiled(model)
    now = [0.0]
    check = CompileCheck(PLANNED, planned, StepTimer(Stopwatch(clock=lambda: now[0])))
    check.add(record)
    ran = []
    for _ in range(steps):
        on_compiled = model.forward is not record.eager
        ran.append("compiled" if on_compiled else "eager")
        now[0] += (compiled_ms if on_compiled else eager_ms) / 1e3
        check.after_step()
    return check, record, ran


def test_the_first_steps_run_eager_then_compiled_and_a_faster_compile_stays():
    check, _, ran = drive(eager_ms=3.0, compiled_ms=2.0, steps=STEPS + 5)
    assert ran[:EAGER_END] == ["eager"] * EAGER_END and set(ran[EAGER_END:]) == {"compiled"}
    assert check.choice is not None and check.choice.value is True
    assert check.eager == [pytest.approx(0.003)] * 3 and check.compiled == [pytest.approx(0.002)] * 3
    assert "confirmed on this run: compiled steps ran 1.50x eager (2 against 3 ms" in check.choice.reason
    assert check.choice.reason.startswith(PLANNED.reason)


def test_a_slower_compile_is_dropped_and_the_model_runs_its_own_forward_from_then_on():
    check, record, ran = drive(eager_ms=2.2, compiled_ms=2.85, steps=STEPS + 5)
    assert check.choice is not None and check.choice.value is False
    assert ran[STEPS:] == ["eager"] * 5
    assert record.module is not None and record.module.forward == record.eager
    assert "compiled steps ran 0.77x eager (2.85 against 2.2 ms" in check.choice.reason
    assert f"eager from step {STEPS + 1} (the compile took 4.0 s)" in check.choice.reason


def test_a_compile_within_the_noise_of_eager_is_not_kept():
    check, _, _ = drive(eager_ms=2.0, compiled_ms=1.98)  # 1.01x: under the 3% a few blocks can tell
    assert check.choice is not None and check.choice.value is False


def test_the_slowest_blocks_do_not_decide_only_the_fastest_of_each():
    model = nn.Linear(2, 2)
    record = fake_compiled(model)
    now = [0.0]
    check = CompileCheck(PLANNED, 100_000, StepTimer(Stopwatch(clock=lambda: now[0])))
    check.add(record)
    for step in range(1, STEPS + 1):
        compiled = model.forward is not record.eager
        disturbed = step in (EAGER_END + 6, EAGER_END + 7)  # a neighbour's load in one compiled block
        now[0] += 0.002 if compiled and not disturbed else 0.05 if disturbed else 0.003
        check.after_step()
    assert check.choice is not None and check.choice.value is True


def test_a_run_too_short_for_any_compile_to_repay_is_not_compiled_at_all():
    # The digits CNN on an H200: 2,000 steps of 2.2 ms are 4.4 s, of which a compile (3 s or more) could save 2.2.
    check, record, ran = drive(eager_ms=2.2, compiled_ms=0.5, steps=STEPS + 5, planned=2000)
    assert ran == ["eager"] * (STEPS + 5) and record.parked is not None and record.parked.calls == 0
    assert check.choice is not None and check.choice.value is False
    assert "eager steps take 2.2 ms: 2000 of them (4.4 s) cannot repay a compile" in check.choice.reason
    long_run, _, _ = drive(eager_ms=2.2, compiled_ms=0.5, steps=STEPS + 5, planned=3000)  # 6.6 s: worth a try
    assert long_run.choice is not None and long_run.choice.value is True


def test_until_it_decides_the_plan_says_the_compile_is_being_checked():
    check, _, _ = drive(eager_ms=3.0, compiled_ms=2.0, steps=4)
    assert check.choice is None
    assert "eager so far: 4 of" in check.explain().reason and check.explain().value is True


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.fixture
def rule_compiles(monkeypatch):
    """The compile rule says yes here (as on a GPU for a long run), and compiling installs a stand-in whose forward
    pauses ``pause[0]`` seconds; its record is kept in ``made``."""
    made: list[CompileRecord] = []
    pause = [0.0]

    def resolve(requested, facts, *, planned_steps, supported):
        return PLANNED if requested == "auto" else Choice(requested in (True, "on"), "requested")

    def compile_module(model, **options):
        made.append(fake_compiled(model, pause[0]))
        return made[-1]

    monkeypatch.setattr(compile_home, "resolve_compile", resolve)
    monkeypatch.setattr(compile_home, "compile_module", compile_module)
    return made, pause


def train(rt: Runtime, steps: int) -> nn.Module:
    torch.manual_seed(0)
    built = Tiny()
    model, optimizer = rt.setup(built, torch.optim.SGD(built.parameters(), lr=0.1))
    inputs, targets = torch.randn(4, 8), torch.randn(4, 2)
    for _ in range(steps):
        with rt.autocast():
            loss = nn.functional.mse_loss(model(inputs), targets)
        rt.backward(loss)
        rt.step(optimizer)
    return model


def test_the_runtime_checks_an_automatic_compile_and_drops_a_slower_one(rule_compiles):
    made, paused = rule_compiles
    paused[0] = 0.004  # a forward 4 ms slower per call loses to eager whatever the machine
    rt = Runtime(devices="cpu", precision="fp32", planned_steps=10**7)  # a run long enough to try
    model = train(rt, STEPS + 4)
    record = made[0]
    plan = rt.explain().compile
    assert plan.value is False and f"eager from step {STEPS + 1}" in plan.reason
    assert record.parked is not None and record.parked.calls == STEPS - EAGER_END  # only in its own blocks
    assert model.forward == record.eager


def test_a_requested_compile_is_not_checked(rule_compiles):
    _, paused = rule_compiles
    paused[0] = 0.004
    rt = Runtime(devices="cpu", precision="fp32", compile="on", planned_steps=5000)
    model = train(rt, STEPS + 2)
    assert model.forward.calls == STEPS + 2  # compiled from the first step to the last, slower or not
    assert rt.explain().compile.value is True and "checked" not in rt.explain().compile.reason


def test_a_bench_row_warms_up_until_the_compile_check_has_decided(rule_compiles):
    _, paused = rule_compiles
    paused[0] = 0.004
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
    task = Task(model=Tiny, loss_fn=nn.functional.mse_loss, train_data=data, batch_size=4, name="tiny")
    runner, _, _ = warm_up(task, Setting("auto", "cpu", "auto", None, 4), window=5, planned=10**7, seed=0)
    assert runner.runtime is not None and not runner.runtime.compile_checking  # the timed windows run eager
    assert runner.runtime.explain().compile.value is False
