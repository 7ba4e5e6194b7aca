"""An unmeasured "auto" precision checked on the run's own steps: the candidate the rule leaves open, the comparison
of the two precisions' outputs on the phase's first batch, and the schedule that keeps the faster on a fake clock."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
from torch import nn

from devices import CPU_AMX, CPU_ARM, CPU_AVX2, CPU_AVX512_BF16, H100, V100
from graph_standins import Capture
from graph_standins import Net as GraphNet
from redline.plan import Choice
from redline.plan.precision import live_candidate, resolve_precision
from redline.runtime.compile_check import (
    BLOCK,
    EAGER_END,
    PHASE,
    SETTLE,
    CompileCheck,
)
from redline.runtime.graphs import GraphRecord
from redline.runtime.precision_check import TOLERANCE, PrecisionSwitch, compare_outputs
from redline.runtime.runtime import Runtime
from redline.runtime.stopwatch import StepTimer, Stopwatch

# -- which precision is checked ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("facts", "expected"),
    [(CPU_AMX, "bf16-mixed"), (CPU_AVX512_BF16, "bf16-mixed"), (CPU_AVX2, None), (CPU_ARM, None), (H100, "fp32"),
     (V100, None)],
)  # fmt: skip
def test_auto_leaves_open_the_other_of_fp32_and_bf16_where_the_device_runs_bf16_fast(facts, expected):
    chosen = resolve_precision("auto", facts).value
    assert live_candidate("auto", chosen, facts) == expected  # V100: the rule's fp16 is never switched mid-run


def test_a_precision_asked_for_is_never_checked():
    assert live_candidate("fp32", "fp32", CPU_AMX) is None
    assert live_candidate("bf16-mixed", "bf16-mixed", H100) is None


# -- comparing the outputs ----------------------------------------------------------------------------


def test_outputs_within_the_tolerance_pass_and_say_by_how_much():
    a = torch.randn(8, 10)
    worst, said = compare_outputs((a, {"x": a}), (a * 1.01, {"x": a}))
    assert worst == pytest.approx(0.01, rel=1e-3) and said == "outputs within 1.0% of fp32's"


@pytest.mark.parametrize(
    ("other", "said"),
    [
        (lambda a: a + 0.2 * a.norm() / math.sqrt(a.numel()), "depart from fp32's by"),
        (lambda a: torch.full_like(a, float("nan")), "not finite where fp32's are"),
        (lambda a: a[:4], "other shapes"),
    ],
)
def test_outputs_that_depart_or_are_not_finite_fail(other, said):
    a = torch.randn(8, 10)
    worst, reason = compare_outputs(a, other(a))
    assert worst > TOLERANCE and said in reason


def test_fp32_outputs_that_are_not_finite_leave_nothing_to_hold_bf16_against():
    a = torch.full((3,), float("inf"))
    assert compare_outputs(a, torch.zeros(3)) == (0.0, "not compared by value: fp32's own outputs are not finite")


def test_a_mask_of_minus_infinity_is_held_apart_and_the_finite_values_are_still_compared():
    # a -inf mask (illegal actions, padded vocabulary) turned the comparison off, and a bf16 that was all wrong stayed
    a = torch.tensor([[1.0, float("-inf"), 3.0, float("nan")]])
    assert compare_outputs(a, a * 1.001)[1] == "outputs within 0.1% of fp32's"
    worst, said = compare_outputs(a, torch.tensor([[1e4, float("-inf"), -3e4, float("nan")]]))
    assert worst > TOLERANCE and said.startswith("its outputs depart from fp32's by")
    unmasked = torch.tensor([[1.0, 0.0, 3.0, float("nan")]])  # the mask lost: a value where fp32 has -inf
    assert compare_outputs(a, unmasked) == (
        math.inf,
        "its outputs are not the infinities or NaNs fp32's give where fp32's are not finite",
    )


# -- the switch on a real module ----------------------------------------------------------------------


class Net(nn.Module):
    """A small MLP with BatchNorm and dropout; ``offset`` is added to its output under autocast only (a model whose
    numbers bf16 cannot hold)."""

    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return out + self.offset if torch.is_autocast_enabled("cpu") else out


def switch_on(net: nn.Module, planned: str = "fp32", candidate: str = "bf16-mixed") -> tuple[PrecisionSwitch, list]:
    applied: list[str] = []
    switch = PrecisionSwitch(Choice(planned, "auto: the rule"), candidate, applied.append, "cpu")
    switch.watch(net)
    switch.use(candidate)
    return switch, applied


def bf16(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return net(x)


def test_the_first_training_forward_in_bf16_is_held_against_fp32_and_goes_on_in_bf16():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(32, 6)
    switch, applied = switch_on(net)
    assert applied == ["bf16-mixed"] and switch.current == "bf16-mixed"
    with torch.no_grad():
        bf16(net, x)  # evaluation in between is not compared
    assert switch.compared == "" and net._forward_hooks
    torch.manual_seed(1)
    out = bf16(net, x)
    assert out.dtype == torch.bfloat16 and out.requires_grad
    assert switch.failed is None and switch.compared.startswith("outputs within")
    assert not net._forward_hooks and not net._forward_pre_hooks  # compared once, then the hooks are gone
    torch.manual_seed(0)
    fresh = Net()
    with torch.no_grad():
        bf16(fresh, x)  # the same evaluation forward (in training mode, so it moved the statistics too)
    torch.manual_seed(1)
    expected = bf16(fresh, x)
    assert torch.equal(out, expected)  # the same dropout draw as without the comparison: the random streams put back
    for name, buffer in net.named_buffers():  # the statistics moved once, by the step's own forward, not twice
        assert torch.equal(buffer, dict(fresh.named_buffers())[name]), name


def test_bf16_outputs_that_depart_from_fp32_are_dropped_and_the_step_goes_on_with_fp32s():
    torch.manual_seed(0)
    net, x = Net(offset=50.0), torch.randn(16, 6)
    switch, _ = switch_on(net)
    torch.manual_seed(0)
    reference = Net(offset=50.0)
    net.body[3].p = reference.body[3].p = 0.0  # no dropout: fp32's output is known
    out = bf16(net, x)
    assert switch.failed is not None and "bf16-mixed was dropped: its outputs depart from fp32's by" in switch.failed
    assert switch.fallback == "fp32"
    assert out.dtype == torch.float32 and out.requires_grad
    assert torch.allclose(out, reference(x), atol=1e-6)  # fp32's output, with autograd: the step trains as fp32
    out.sum().backward()
    assert net.body[0].weight.grad is not None


def test_a_model_copied_or_pickled_while_the_check_is_armed_carries_none_of_it():
    # between the step that arms the check and the next training forward, deepcopy failed ("cannot pickle
    # 'generator' object") and torch.save(model) too: the hooks were bound methods holding the Runtime's switch
    import copy
    import io
    import pickle

    class Runtime:  # what a Runtime's switch holds, through ``apply``: things no copy or pickle takes
        def __init__(self):
            self.steps = (step for step in range(3))

        def apply(self, name):
            pass

    net = Net()
    switch = PrecisionSwitch(Choice("fp32", "auto: the rule"), "bf16-mixed", Runtime().apply, "cpu")
    switch.watch(net)
    switch.use("bf16-mixed")
    copied = copy.deepcopy(net)
    pickle.loads(pickle.dumps(net))
    torch.save(net, io.BytesIO())
    assert copied(torch.randn(4, 6)).dtype == torch.float32 and switch.compared == ""  # the copy checks nothing
    bf16(net, torch.randn(4, 6))
    assert switch.compared.startswith("outputs within")  # the model itself is still checked


def test_a_forward_that_raises_after_bf16_was_dropped_leaves_autocast_as_it_found_it():
    # the fp32 fallback's autocast(enabled=False), entered in the pre-hook, was left only by the forward hook: a
    # forward that raised left it open for good, and autocast's weight cache was never cleared after
    class Fails(Net):
        def forward(self, x):
            out = super().forward(x)
            if not torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
                return out  # the comparison's own forwards
            raise ValueError("a bad batch the loop skips")

    net = Fails(offset=50.0)
    switch, _ = switch_on(net)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="a bad batch"):
            net(torch.randn(4, 6))
        assert torch.is_autocast_enabled("cpu")  # the fp32 fallback's context was left with the failed forward
    assert switch.failed is not None and not torch.is_autocast_enabled("cpu")


def test_a_loop_whose_rule_steps_run_under_its_own_autocast_is_not_timed_as_the_rules():
    # the loop's own autocast(bf16) inside rt.autocast(): the "fp32" steps ran bf16, timed against bf16, and the
    # Plan said fp32 "checked on this run"
    net = Net()
    applied: list[str] = []
    switch = PrecisionSwitch(Choice("fp32", "auto: the rule"), "bf16-mixed", applied.append, "cpu")
    switch.watch(net)
    with torch.no_grad():
        bf16(net, torch.randn(4, 6))  # evaluation says nothing
    assert switch.outside == "" and net._forward_pre_hooks
    bf16(net, torch.randn(4, 6))
    assert switch.outside.startswith("the loop's forward ran under autocast to torch.bfloat16, not in the precision")
    assert not net._forward_pre_hooks  # looked once
    plain = Net()
    switch = PrecisionSwitch(Choice("fp32", "auto: the rule"), "bf16-mixed", applied.append, "cpu")
    switch.watch(plain)
    plain(torch.randn(4, 6))  # the rule's fp32, as rt.autocast() gives it
    assert switch.outside == "" and not plain._forward_pre_hooks


def test_a_loop_whose_forward_runs_outside_rt_autocast_is_not_checked():
    net = Net()
    switch, _ = switch_on(net)
    out = net(torch.randn(4, 6))  # no autocast: the loop's own precision
    assert out.dtype == torch.float32
    assert switch.failed is not None and "the loop's forward ran without autocast" in switch.failed
    assert switch.fallback == "fp32"  # the rule's


def test_a_validation_in_eval_mode_outside_rt_autocast_waits_for_the_training_forward():
    # a sanity validation without no_grad cancelled the check: "the loop's forward ran without autocast"
    torch.manual_seed(0)
    net, x = Net(), torch.randn(8, 6)
    switch, _ = switch_on(net)
    net.eval()
    net(x)  # the validation, outside rt.autocast()
    assert switch.failed is None and not switch.compared and switch._handles  # still waiting
    bf16(net, x)  # the training forward, in eval mode too (frozen BatchNorm), inside rt.autocast(): it counts
    assert switch.failed is None and switch.compared.startswith("outputs within") and not switch._handles
    training = Net()
    switch, _ = switch_on(training)
    training(x)  # a forward in training mode outside rt.autocast() is the loop's training forward, as before
    assert switch.failed is not None and "the loop's forward ran without autocast" in switch.failed
    rule = Net()
    switch = PrecisionSwitch(Choice("bf16-mixed", "auto: the rule"), "fp32", lambda name: None, "cpu")
    switch.watch(rule)
    rule.eval()
    rule(x)  # the validation, in the rule's phase: not the first training forward
    assert switch.outside == "" and rule._forward_pre_hooks
    bf16(rule, x)  # the training forward, in eval mode, inside rt.autocast()
    assert switch.outside == "" and not rule._forward_pre_hooks


def test_where_the_rule_chose_bf16_a_departing_bf16_leaves_fp32():
    torch.manual_seed(0)
    net = Net(offset=50.0)
    switch, applied = switch_on(net, planned="bf16-mixed", candidate="fp32")
    out = net(torch.randn(8, 6))  # the candidate, fp32, runs without autocast
    assert applied == ["fp32"] and out.dtype == torch.float32
    assert switch.failed is not None and switch.fallback == "fp32"


# -- the schedule, on a fake clock ----------------------------------------------------------------------


def drive(
    fp32_ms: float,
    bf16_ms: float,
    steps: int,
    *,
    planned: str = "fp32",
    planned_steps: int = 0,
    memory: float | None = None,
    graphs_ms: float | None = None,
    fail: str | None = None,
    compared: bool = True,
) -> tuple[CompileCheck, PrecisionSwitch, list[str]]:
    """Run a check for ``steps`` steps, each costing what the precision it ran in costs (graphed steps cost
    ``graphs_ms``); returns the check, the switch and each step's form. ``compared``: the outputs of the phase's first
    forward were held against fp32's (no module is watched here to compare them)."""
    now = [0.0]
    candidate = "bf16-mixed" if planned == "fp32" else "fp32"
    current = [planned]
    switch = PrecisionSwitch(Choice(planned, "auto: the rule"), candidate, lambda name: current.__setitem__(0, name),
                             "cpu")  # fmt: skip
    if compared:
        switch.compared, switch.by_value = "outputs within 0.4% of fp32's", True
    check = CompileCheck(Choice(False, "auto: no compile"), planned_steps, StepTimer(Stopwatch(clock=lambda: now[0])))
    check.add_precision(switch, lambda: memory)
    graphs, net, x = None, GraphNet(), torch.randn(2, 4)
    if graphs_ms is not None:
        graphs = GraphRecord(net, net.forward, capture=Capture())
        check.add_graphs(graphs, Choice(True, "auto: graphs"))
    ran = []
    for _ in range(steps):
        if fail is not None and current[0] == candidate and switch.failed is None:
            switch.failed, switch.fallback = fail, "fp32"
        graphed = graphs is not None and graphs.on
        net(x)
        if graphs is not None:
            graphs.stepped()
        ran.append("graphs" if graphed else current[0])
        now[0] += (graphs_ms if graphed else fp32_ms if current[0] == "fp32" else bf16_ms) / 1e3
        check.after_step()
    return check, switch, ran


def test_bf16_that_beats_fp32_by_the_margin_is_kept_from_the_step_after_its_phase():
    check, switch, ran = drive(fp32_ms=4.0, bf16_ms=2.5, steps=EAGER_END + PHASE + 5)
    assert ran[:EAGER_END] == ["fp32"] * EAGER_END
    assert set(ran[EAGER_END:]) == {"bf16-mixed"} and check.decided
    choice = check.explain_precision()
    assert choice is not None and choice.value == "bf16-mixed"
    assert choice.reason.startswith(
        f"measured on this run: bf16-mixed steps ran 1.60x fp32 (2.5 against 4 ms, fastest of 3 blocks of {BLOCK} steps"
    )
    assert f"bf16-mixed from step {EAGER_END + PHASE + 1}; the rule alone would have kept fp32 (auto: the rule)" in (
        choice.reason
    )
    assert "outputs within 0.4% of fp32's" in choice.reason
    assert not switch._handles


def test_bf16_whose_outputs_were_not_compared_is_not_adopted_on_its_timing_alone():
    # a loop training in eval mode ran no forward the comparison saw, and bf16, 1.89x faster, was adopted unchecked
    check, _, ran = drive(fp32_ms=4.0, bf16_ms=2.5, steps=EAGER_END + PHASE + 2, compared=False)
    assert set(ran[EAGER_END + PHASE :]) == {"fp32"} and check.decided
    choice = check.explain_precision()
    assert choice is not None and choice.value == "fp32"
    assert choice.reason.startswith("auto: the rule; checked on this run: bf16-mixed steps ran 1.60x fp32")
    after = f"fp32 from step {EAGER_END + PHASE + 1}"
    assert f"but its outputs were not held against fp32's, so it is not adopted: {after}" in choice.reason


@pytest.mark.parametrize("bf16_ms", [3.8, 5.0])  # 1.05x, and 0.8x: slower, but not so far that one block decides
def test_bf16_short_of_the_margin_leaves_fp32_after_its_whole_phase(bf16_ms):
    check, _, ran = drive(fp32_ms=4.0, bf16_ms=bf16_ms, steps=EAGER_END + PHASE + 3)
    assert ran[EAGER_END : EAGER_END + PHASE] == ["bf16-mixed"] * PHASE and set(ran[EAGER_END + PHASE :]) == {"fp32"}
    choice = check.explain_precision()
    assert choice is not None and choice.value == "fp32"
    assert f"auto: the rule; checked on this run: bf16-mixed steps ran {4.0 / bf16_ms:.2f}x fp32" in choice.reason


def test_bf16_whose_first_block_is_far_from_winning_stops_its_phase_there():
    check, _, ran = drive(fp32_ms=4.0, bf16_ms=6.0, steps=EAGER_END + PHASE)
    short = SETTLE + BLOCK
    assert ran[EAGER_END : EAGER_END + short] == ["bf16-mixed"] * short
    assert set(ran[EAGER_END + short :]) == {"fp32"} and check.decided
    choice = check.explain_precision()
    assert choice is not None and choice.value == "fp32"
    assert f"0.67x fp32 (6 against 4 ms, fastest of 1 block of {BLOCK} steps" in choice.reason
    assert f"fp32 from step {EAGER_END + short + 1}" in choice.reason


def test_a_comparison_that_dropped_bf16_ends_the_phase_at_once():
    check, _, ran = drive(fp32_ms=4.0, bf16_ms=1.0, steps=EAGER_END + 4, fail="bf16-mixed was dropped: its outputs")
    assert ran[EAGER_END:] == ["bf16-mixed", "fp32", "fp32", "fp32"]
    choice = check.explain_precision()
    assert choice is not None and choice.value == "fp32"
    assert f"checked on this run: bf16-mixed was dropped: its outputs: fp32 from step {EAGER_END + 2}" in choice.reason


def test_steps_too_long_to_risk_a_slower_block_are_not_checked_unless_the_run_is_long_enough():
    check, _, ran = drive(fp32_ms=100.0, bf16_ms=10.0, steps=EAGER_END + 2)
    assert set(ran) == {"fp32"} and check.decided
    choice = check.explain_precision()
    assert choice is not None and choice.value == "fp32"
    assert "not checked on this run: its steps take 100 ms, so a block of bf16-mixed steps could cost up to 1.4 s" in (
        choice.reason
    )
    check, _, ran = drive(fp32_ms=100.0, bf16_ms=10.0, steps=EAGER_END + PHASE + 1, planned_steps=1000)
    assert ran[-1] == "bf16-mixed"  # 2% of a 100 s run repays the risk


def test_fp32_is_not_tried_on_a_gpu_whose_memory_bf16_already_filled():
    check, _, _ = drive(fp32_ms=4.0, bf16_ms=2.0, steps=EAGER_END + 1, planned="bf16-mixed", memory=0.6)
    choice = check.explain_precision()
    assert choice is not None and choice.value == "bf16-mixed"
    assert "its steps filled 60% of the device's memory" in choice.reason
    check, _, _ = drive(fp32_ms=2.0, bf16_ms=2.4, steps=EAGER_END + PHASE + 1, planned="bf16-mixed", memory=0.2)
    choice = check.explain_precision()
    assert choice is not None and choice.value == "fp32"  # the launch-bound CNN: bf16 slower, fp32 kept
    assert "measured on this run: fp32 steps ran 1.20x bf16-mixed" in choice.reason


def test_graphs_are_timed_after_the_precision_against_eager_steps_in_the_precision_kept():
    check, _, ran = drive(fp32_ms=4.0, bf16_ms=2.0, graphs_ms=1.98, steps=EAGER_END + 2 * PHASE + 2)
    assert ran[EAGER_END : EAGER_END + PHASE] == ["bf16-mixed"] * PHASE
    assert ran[EAGER_END + PHASE : EAGER_END + 2 * PHASE] == ["graphs"] * PHASE
    graphs = check.explain_graphs()
    assert graphs is not None and graphs.value is False  # 1.01x bf16's eager: short of KEEP, though 2x fp32's
    assert "graphed steps ran 1.01x eager (1.98 against 2 ms" in graphs.reason
    assert ran[-2:] == ["bf16-mixed", "bf16-mixed"]


def test_until_it_decides_the_plan_says_the_precision_is_being_checked():
    check, _, _ = drive(fp32_ms=4.0, bf16_ms=2.0, steps=EAGER_END + 3)
    choice = check.explain_precision()
    assert choice is not None and choice.value == "fp32"
    checking = (
        f"being checked on this run: bf16-mixed timed against fp32 after {EAGER_END} steps (step {EAGER_END + 3} "
    )
    assert checking in choice.reason


# -- the Runtime ---------------------------------------------------------------------------------------


def train(rt: Runtime, steps: int, costs: dict[str, float], net: nn.Module | None = None) -> nn.Module:
    """Train a small model ``steps`` steps in the user's loop shape, each step costing ``costs[precision]`` seconds on
    the check's clock."""
    torch.manual_seed(0)
    net = net or nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    now = [0.0]
    if rt._compile_check is not None:
        rt._compile_check.timer.stopwatch.clock = lambda: now[0]
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for _ in range(steps):
        with rt.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        rt.backward(loss)
        now[0] += costs[rt.precision.name]
        rt.step(optimizer)
    return net


def test_the_runtime_on_an_amx_cpu_checks_bf16_on_its_steps_and_keeps_it_when_faster(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", compile="off") as rt:
        net = train(rt, EAGER_END + PHASE + 2, {"fp32": 0.004, "bf16-mixed": 0.0025})
        assert rt.precision.name == "bf16-mixed" and not rt.compile_checking
        plan = rt.explain().precision
        assert plan.value == "bf16-mixed" and plan.reason.startswith("measured on this run: bf16-mixed steps ran 1.60x")
        assert "outputs within" in plan.reason
        with rt.autocast():
            assert torch.is_autocast_enabled("cpu")
    assert not net._forward_hooks and not net._forward_pre_hooks


def test_the_runtime_keeps_fp32_where_bf16_is_slower_and_a_closed_runtime_leaves_no_hook(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", compile="off") as rt:
        train(rt, EAGER_END + PHASE, {"fp32": 0.004, "bf16-mixed": 0.006})
        assert rt.precision.name == "fp32" and "checked on this run: bf16-mixed steps ran 0.67x" in (
            rt.explain().precision.reason
        )
    with Runtime(devices="cpu", compile="off") as rt:  # closed while the bf16 phase waits for its first forward
        net = train(rt, EAGER_END, {"fp32": 0.004, "bf16-mixed": 0.002})
        assert net._forward_hooks
    assert not net._forward_hooks and not net._forward_pre_hooks


@pytest.mark.parametrize(
    ("cpu", "fields"),
    [
        ("avx2", {}),  # no fast bf16: nothing to check
        ("amx", {"precision": "fp32"}),  # asked for
        ("amx", {"measured": {"precision": Choice("fp32", "measured: a trial")}}),
        ("amx", {"deterministic": True}),  # a run that must repeat itself cannot follow a timing
    ],
)
def test_a_precision_given_measured_or_without_a_fast_other_is_not_checked(monkeypatch, cpu, fields):
    monkeypatch.setenv("REDLINE_CPU", cpu)
    with Runtime(devices="cpu", compile="off", **fields) as rt:
        train(rt, EAGER_END + PHASE + 1, {"fp32": 0.004, "bf16-mixed": 0.001})
        assert rt.precision.name == "fp32" and rt._compile_check is None
        assert "on this run" not in rt.explain().precision.reason


# -- what the review found ------------------------------------------------------------------------------


class Aux(nn.Module):
    """Keeps an auxiliary loss as an attribute, as mixture-of-experts layers do, and a feature a hook reads."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        self.aux = out.float().pow(2).mean()
        return out


def test_the_steps_own_forward_runs_last_so_what_it_leaves_behind_keeps_its_autograd():
    net = Aux()
    switch, _ = switch_on(net)
    bf16(net, torch.randn(8, 4))
    assert switch.compared.startswith("outputs within")
    assert net.aux is not None and net.aux.requires_grad  # the no_grad comparison ran first, not last


def test_a_users_pre_hook_that_changes_the_input_applies_once_to_each_forward():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    net.register_forward_pre_hook(lambda module, args: (args[0] * 3.0,))
    switch, _ = switch_on(net)
    bf16(net, torch.randn(8, 4))
    assert switch.failed is None and switch.compared.startswith("outputs within")


@dataclasses.dataclass
class Result:
    logits: torch.Tensor


class Returns(Net):
    def forward(self, x: torch.Tensor) -> Result:  # type: ignore[override]
        return Result(super().forward(x))


def test_outputs_in_a_dataclass_are_compared_too():
    net = Returns(offset=50.0)
    switch, _ = switch_on(net)
    out = bf16(net, torch.randn(8, 6))
    assert switch.failed is not None and "depart from fp32's" in switch.failed
    assert out.logits.dtype == torch.float32


def test_a_precision_a_failed_comparison_changed_is_given_eager_blocks_of_its_own_before_graphs_are_timed():
    check, _, ran = drive(
        fp32_ms=4.0, bf16_ms=2.0, graphs_ms=3.0, planned="bf16-mixed", fail="bf16-mixed was dropped: depart",
        steps=EAGER_END + 1 + 2 * PHASE + 2,
    )  # fmt: skip
    assert ran[EAGER_END : EAGER_END + 1 + PHASE] == ["fp32"] * (1 + PHASE)  # fp32 from the failed comparison on
    assert check.eager == [pytest.approx(0.004)] * 3  # timed anew in fp32
    graphs = check.explain_graphs()
    assert (
        graphs is not None
        and graphs.value is True
        and "graphed steps ran 1.33x eager (3 against 4 ms" in (graphs.reason)
    )


def test_a_second_model_or_a_closed_runtime_ends_the_check_with_the_rule_s_precision(monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", compile="off") as rt:
        first = nn.Linear(4, 2)
        rt.setup(first, torch.optim.SGD(first.parameters(), lr=0.1))
        second = nn.Linear(4, 2)
        rt.setup(second, torch.optim.SGD(second.parameters(), lr=0.1))
        plan = rt.explain().precision
        assert plan.value == "fp32" and "not checked on this run: a second model was set up" in plan.reason
    rt = Runtime(devices="cpu", compile="off")
    net = train(rt, 3, {"fp32": 0.004, "bf16-mixed": 0.002})
    rt.close()
    train_more = rt._compile_check
    assert train_more is not None
    for _ in range(EAGER_END + PHASE):  # a loop that steps on after closing: nothing switches, no hook comes back
        train_more.after_step()
    assert rt.precision.name == "fp32" and not net._forward_hooks and not net._forward_pre_hooks
    assert "not checked on this run: the Runtime was closed before it decided" in rt.explain().precision.reason


def test_a_forward_that_changes_its_input_in_place_does_so_once_at_the_compared_step():
    class Halves(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x.mul_(0.5))

    net, x = Halves(), torch.ones(8, 4)
    switch, _ = switch_on(net)
    bf16(net, x)
    assert switch.failed is None and torch.equal(x, torch.full((8, 4), 0.5))  # the comparison ran on copies


def test_a_forward_that_fails_in_bf16_only_drops_it_and_the_step_runs_in_fp32():
    class Scatter(nn.Module):  # index_add_ into a float32 buffer, as message passing does: no bf16 source allowed
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(2, 3)
            return out.index_add_(0, torch.tensor([0, 1, 0, 1]), self.layer(x))

    net = Scatter()
    switch, _ = switch_on(net)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(torch.randn(4, 4))  # would raise without the check: the run in fp32 must not break
        assert torch.is_autocast_enabled("cpu")  # the step's fp32 context ended with its forward
    assert out.dtype == torch.float32 and out.requires_grad
    assert switch.failed is not None and "its forward in bf16-mixed failed: RuntimeError" in switch.failed
    assert switch.fallback == "fp32" and not net._forward_hooks
    check, _, _ = drive(fp32_ms=4.0, bf16_ms=2.0, steps=5)
    check.drop_precision("a second model was set up")
    assert check.end == EAGER_END  # a dropped precision phase is not counted in the schedule's end


@pytest.mark.parametrize(
    ("evaluation", "every"),
    [("eval mode, no_grad", 10), ("no_grad", 10), ("eval mode", 10), ("eval mode, outside rt.autocast()", 6)],
)
def test_what_the_loop_does_between_steps_is_not_timed_against_the_phase_it_falls_in(monkeypatch, evaluation, every):
    # An evaluation every 10 steps fell in bf16's first block (steps 21-25) and made it lose 0.09x, where its steps ran
    # 1.6x fp32's: the phase stopped there. Steps are timed from their first training forward to their optimizer step.
    # One in eval mode, neither under no_grad nor in rt.autocast(), every 6 steps (one falls where bf16's phase
    # starts), was taken for the training forward, and the check ended: "the loop's forward ran without autocast".
    monkeypatch.setenv("REDLINE_CPU", "amx")
    costs = {"fp32": 0.004, "bf16-mixed": 0.0025}
    with Runtime(devices="cpu", compile="off") as rt:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        assert rt._compile_check is not None
        now = [0.0]
        rt._compile_check.timer.stopwatch.clock = lambda: now[0]
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        for step in range(1, EAGER_END + PHASE + 2):
            now[0] += 0.03  # the loader's next batch: the same in either precision
            with rt.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            rt.backward(loss)
            now[0] += costs[rt.precision.name]
            rt.step(optimizer)
            if step % every == 0:
                model.train("eval mode" not in evaluation)
                inside = contextlib.nullcontext() if "outside" in evaluation else rt.autocast()
                with torch.set_grad_enabled("no_grad" not in evaluation), inside:
                    model(x)
                now[0] += 0.5
                model.train()
        assert not rt.compile_checking and not net._forward_pre_hooks  # decided: the timer let go of the model
        plan = rt.explain().precision
        assert plan.value == "bf16-mixed" and plan.reason.startswith(
            "measured on this run: bf16-mixed steps ran 1.60x fp32 (2.5 against 4 ms"
        )
        assert "outputs within" in plan.reason


# -- a loop that trains in eval mode ---------------------------------------------------------------------


def test_a_training_forward_in_eval_mode_is_compared_and_a_departing_bf16_dropped():
    # frozen BatchNorm and dropout (model.eval() while training): the forward was taken for an evaluation, never
    # compared, and bf16 adopted on its timing though its outputs departed ~100%
    net = Net(offset=50.0).eval()
    switch, _ = switch_on(net)
    out = bf16(net, torch.randn(8, 6))
    assert switch.failed is not None and "bf16-mixed was dropped: its outputs depart from fp32's by" in switch.failed
    assert out.dtype == torch.float32 and out.requires_grad


def test_outputs_with_nothing_to_compare_by_value_do_not_count_as_compared():
    class Opaque(nn.Module):  # returns an object the comparison cannot look into
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> object:
            return type("Out", (), {"logits": self.layer(x)})()

    switch, _ = switch_on(Opaque())
    bf16(switch.module, torch.randn(8, 4))
    assert switch.failed is None and switch.compared.startswith("not compared by value") and not switch.by_value
    plain, _ = switch_on(nn.Linear(4, 2))
    bf16(plain.module, torch.randn(8, 4))
    assert plain.compared.startswith("outputs within") and plain.by_value


@pytest.mark.parametrize("cpu", ["amx", "avx512_bf16"])  # the check runs on both; the maths runs on any CPU
def test_a_runtime_loop_training_in_eval_mode_keeps_fp32_where_bf16_departs(monkeypatch, cpu):
    monkeypatch.setenv("REDLINE_CPU", cpu)
    with Runtime(devices="cpu", compile="off") as rt:
        torch.manual_seed(0)
        net = Net(offset=50.0)
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        model.eval()  # BatchNorm statistics and dropout frozen, trained all the same
        assert rt._compile_check is not None
        now = [0.0]
        rt._compile_check.timer.stopwatch.clock = lambda: now[0]
        x, y = torch.randn(8, 6), torch.randn(8, 3)
        for _ in range(EAGER_END + PHASE + 2):
            with rt.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            rt.backward(loss)
            now[0] += {"fp32": 0.004, "bf16-mixed": 0.0025}[rt.precision.name]  # bf16 would win on its timing
            rt.step(optimizer)
        plan = rt.explain().precision
        assert rt.precision.name == "fp32" and plan.value == "fp32"
        assert "bf16-mixed was dropped: its outputs depart from fp32's by" in plan.reason


# -- a loop that steps its optimizer itself --------------------------------------------------------------


def test_a_loop_that_steps_its_optimizer_itself_is_not_checked_and_the_plan_says_so(monkeypatch):
    # its steps never reached the check, and every checkpoint's Plan said "being checked (step 0 of 35)"
    monkeypatch.setenv("REDLINE_CPU", "amx")
    with Runtime(devices="cpu", compile="off") as rt:
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        for _ in range(3):
            with rt.autocast():
                loss = model(torch.randn(8, 4)).square().mean()
            rt.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        plan = rt.explain().precision
        assert plan.value == "fp32" and not rt.compile_checking
        assert plan.reason.endswith(
            "not checked on this run: the loop steps its optimizer itself (optimizer.step()), and the check counts "
            "rt.step(optimizer)'s"
        )
        assert not net._forward_pre_hooks and not net._forward_hooks  # nothing more to watch


def test_a_loop_stepping_itself_ends_graphs_and_a_compile_under_check_with_the_models_own_forward():
    check, switch, _ = drive(fp32_ms=4.0, bf16_ms=2.0, graphs_ms=1.0, steps=EAGER_END + 2)
    assert switch.current == "bf16-mixed"  # amid bf16's phase
    check.stepped_directly()
    assert check.decided and switch.current == "fp32"  # the rule's, as the run had it before the phase
    graphs = check.explain_graphs()
    assert graphs is not None and graphs.value is False and "the loop steps its optimizer itself" in graphs.reason
    compiled = CompileCheck(Choice(True, "auto: the rule"), 0, StepTimer(Stopwatch(clock=lambda: 0.0)))
    compiled.stepped_directly()
    assert compiled.explain() == Choice(
        False,
        "auto: the rule, but not checked on this run: the loop steps its optimizer itself (optimizer.step()), and "
        "the check counts rt.step(optimizer)'s; not compiled",
    )


def test_the_steps_torchs_state_dict_functions_take_are_not_the_loops_own(monkeypatch, tmp_path):
    # FSDP's get_state_dict and set_state_dict step a fresh optimizer once at lr=0: a checkpoint before the first step,
    # or a resume, ended the check with "the loop steps its optimizer itself"
    monkeypatch.setenv("REDLINE_CPU", "amx")

    def stepping(method):  # the strategy's method, as torch's state-dict functions run it
        def standin(*args, **kwargs):
            optimizer = next(arg for arg in args if isinstance(arg, torch.optim.Optimizer))
            lr = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = 0.0
            optimizer.step()
            for group, was in zip(optimizer.param_groups, lr, strict=True):
                group["lr"] = was
            return method(*args, **kwargs)

        return standin

    with Runtime(devices="cpu", compile="off") as rt:
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        rt.save(tmp_path / "ck")
        for name in ("state_dict", "load_state_dict", "save", "load"):
            monkeypatch.setattr(rt.strategy, name, stepping(getattr(rt.strategy, name)))
        rt.load_state_dict(rt.state_dict())
        rt.save(tmp_path / "ck2")
        rt.load(tmp_path / "ck")
        assert rt.compile_checking
        assert "steps its optimizer itself" not in rt.explain().precision.reason
