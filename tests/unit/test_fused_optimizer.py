"""On a CPU the optimizer is rebuilt fused only where its step, timed on a copy of the parameters, ran faster."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import redline.runtime.fused as fused
from devices import CPU, CPU_AMX, H100, MPS
from redline import Runtime, RuntimeOptions
from redline.hardware.device import probe_device
from redline.plan.optimizer import FUSED_MARGIN, OptimizerFacts, StepTiming, resolve_optimizer, wants_timing


def facts_of(**overrides):
    base = {"name": "AdamW", "has_fused": True, "has_state": False, "impl_set_by_user": False}
    return OptimizerFacts(**{**base, **overrides})


def timing(given_ms: float, fused_ms: float, timed: int = 1000, of: int = 1000) -> StepTiming:
    return StepTiming(given_s=given_ms / 1e3, fused_s=fused_ms / 1e3, timed=timed, of=of)


def test_a_cpu_takes_fused_where_its_timed_step_is_faster_and_says_by_how_much():
    taken = resolve_optimizer(facts_of(), CPU, timed=timing(1.13, 0.36, 417_536, 417_536))
    assert taken.value == "fused"
    assert "3.14x as fast" in taken.reason and "0.36 ms against 1.13 ms a step" in taken.reason
    assert "a copy of its 417,536 parameters" in taken.reason
    kept = resolve_optimizer(facts_of(), CPU, timed=timing(1.0, 1.0 / (FUSED_MARGIN - 0.02)))
    assert kept.value == "as given" and f"not {FUSED_MARGIN}x" in kept.reason
    slower = resolve_optimizer(facts_of(), CPU, timed=timing(1.0, 2.0, 2_097_152, 124_000_000))
    assert slower.value == "as given" and "0.50x as fast" in slower.reason
    assert "2,097,152 of 124,000,000 parameters" in slower.reason
    tiny = resolve_optimizer(facts_of(), CPU, timed=timing(0.031, 0.027))
    assert "27.0 us against 31.0 us a step" in tiny.reason  # not "0.03 ms against 0.03 ms"


def test_a_cpu_keeps_the_optimizer_where_fused_failed_or_was_not_timed():
    failed = resolve_optimizer(facts_of(), CPU, timed="its fused kernel failed on a copy (`fused=True` requires ...)")
    assert failed.value == "as given" and "as its fused kernel failed on a copy (`fused=True` requires" in failed.reason
    untimed = resolve_optimizer(facts_of(), CPU)
    assert untimed.value == "as given" and "not timed" in untimed.reason
    assert resolve_optimizer(facts_of(), MPS, timed=timing(1.0, 0.1)).value == "as given"


def test_only_a_cpu_optimizer_that_could_be_rebuilt_is_timed():
    assert wants_timing(facts_of(), CPU)
    assert not wants_timing(facts_of(), H100)  # fused by rule
    assert not wants_timing(facts_of(), MPS)
    assert not wants_timing(facts_of(impl_set_by_user=True), CPU)
    assert not wants_timing(facts_of(has_state=True), CPU)
    assert not wants_timing(facts_of(has_scheduler=True), CPU)
    assert not wants_timing(facts_of(name="Lion", has_fused=False), CPU)
    assert not wants_timing(facts_of(unfusable="the model has layers with sparse gradients"), CPU)
    assert not wants_timing(facts_of(), CPU, sharded=True)
    # the reasons that keep it are the same on every device that could fuse it
    for facts in (facts_of(has_state=True), facts_of(has_scheduler=True)):
        assert resolve_optimizer(facts, CPU).reason == resolve_optimizer(facts, H100).reason


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model[0].bias.requires_grad_(False)  # frozen: no gradient, no step, not timed
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def test_the_timing_steps_copies_and_leaves_the_model_its_optimizer_and_hooks_alone():
    model, optimizer = model_and_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    optimizer.register_step_post_hook(lambda *args: seen.append(args))
    timed = fused.time_fused(optimizer)
    assert isinstance(timed, StepTiming)
    assert timed.given_s > 0 and timed.fused_s > 0
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert timed.timed == timed.of == trained == 16 * 32 + 32 * 4 + 4
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not any(optimizer.state.values()) and seen == [] and all(p.grad is None for p in model.parameters())


def test_a_large_model_is_timed_on_a_copy_of_its_first_elements(monkeypatch):
    monkeypatch.setattr(fused, "TIMED_BYTES", 400)  # 100 fp32 elements
    _, optimizer = model_and_optimizer()
    timed = fused.time_fused(optimizer)
    assert isinstance(timed, StepTiming)
    assert timed.timed == 100 and timed.of == 16 * 32 + 32 * 4 + 4  # the first weight, cut short


def test_an_empty_parameter_group_is_kept_by_the_rebuild_and_the_timing(monkeypatch):
    """Decay and no-decay groups, the second empty for a model without biases: torch takes an empty group, and so do
    the timing's copies and the fused rebuild (code indexing param_groups[1], or loading a plain torch state, needs
    it)."""
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 4, bias=False))
    optimizer = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": [], "weight_decay": 0.0}])
    assert isinstance(fused.time_fused(optimizer), StepTiming)
    monkeypatch.setattr(fused, "time_fused", lambda optimizer: timing(1.0, 0.3))
    with Runtime(RuntimeOptions(devices="cpu")) as rt:
        _, built = rt.setup(model, optimizer)
        assert built is not optimizer and built.defaults["fused"]
        assert [len(group["params"]) for group in built.param_groups] == [2, 0]
        assert built.param_groups[1]["weight_decay"] == 0.0
        built.load_state_dict(optimizer.state_dict())  # a plain torch state of the same groups loads


def test_a_deterministic_run_is_not_timed_and_keeps_the_optimizer(monkeypatch):
    """Two deterministic runs must train alike: a timing near the margin could choose otherwise the next time."""

    def untimed(optimizer):
        raise AssertionError("timed the optimizer of a deterministic run")

    monkeypatch.setattr(fused, "time_fused", untimed)
    model, optimizer = model_and_optimizer()
    with Runtime(RuntimeOptions(devices="cpu", deterministic=True)) as rt:
        _, built = rt.setup(model, optimizer)
        row = rt.explain().optimizer
    assert built is optimizer and row.value == "as given" and "deterministic run takes no timed choice" in row.reason


def test_a_fused_kernel_that_fails_on_the_copy_is_said_and_the_optimizer_kept(monkeypatch):
    def refused(*args, **kwargs):
        raise RuntimeError("no fused AdamW kernel for this CPU\nsecond line")

    monkeypatch.setattr(torch, "_fused_adamw_", refused)
    model, optimizer = model_and_optimizer()
    assert fused.time_fused(optimizer) == "its fused kernel failed on a copy (no fused AdamW kernel for this CPU)"
    with Runtime(RuntimeOptions(devices="cpu")) as rt:
        _, built = rt.setup(model, optimizer)
        row = rt.explain().optimizer
    assert built is optimizer and row.value == "as given" and "no fused AdamW kernel for this CPU" in row.reason
    capturable = torch.optim.Adam(nn.Linear(4, 2).parameters(), capturable=True)  # torch's for-loop refuses it on CPU
    assert fused.time_fused(capturable).startswith("its step as given failed on a copy (")


@pytest.mark.parametrize(("fused_ms", "expected"), [(0.3, "fused"), (0.99, "as given")])
def test_the_runtime_rebuilds_the_optimizer_fused_only_where_the_timing_says(monkeypatch, fused_ms, expected):
    monkeypatch.setattr(fused, "time_fused", lambda optimizer: timing(1.0, fused_ms))
    model, optimizer = model_and_optimizer()
    hooked = []
    optimizer.register_step_post_hook(lambda *args: hooked.append(1))
    with Runtime(RuntimeOptions(devices="cpu")) as rt:
        model, built = rt.setup(model, optimizer)
        assert rt.explain().optimizer.value == expected
        assert (built is optimizer) == (expected == "as given")
        assert bool(built.defaults.get("fused")) == (expected == "fused")
        loss = model(torch.randn(8, 16)).square().mean()
        rt.backward(loss)
        rt.step(built)
    assert hooked == [1]  # a rebuilt optimizer keeps the user's hooks


def test_each_set_up_models_optimizer_is_explained_in_the_plans_row(monkeypatch):
    """A GAN's Plan gave only the last set-up optimizer's row: the generator's choice went unexplained."""
    monkeypatch.setattr(
        fused, "time_fused", lambda opt: timing(1.0, 0.3 if isinstance(opt, torch.optim.AdamW) else 0.99)
    )
    generator, critic = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 1))
    with Runtime(RuntimeOptions(devices="cpu")) as rt:
        rt.setup(generator, lambda params: torch.optim.AdamW(params, lr=1e-3))
        assert "Linear's" not in rt.explain().optimizer.reason  # one model: its own row, as before
        rt.setup(critic, lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9))
        row = rt.explain().optimizer
        assert row.value == "fused / as given"
        first, second = row.reason.split("; Sequential's SGD: as given, ")
        assert first.startswith("Linear's AdamW: fused, AdamW rebuilt fused: it stepped 3.33x as fast")
        assert "fused" in second and "Linear's" not in second
        rt.setup(generator, lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9))  # a second phase
        assert rt.explain().optimizer.reason.startswith("Linear's SGD: as given, ")  # the generator's new one, first
    with Runtime(RuntimeOptions(devices="cpu")) as rt:  # two models of one class, one kind of optimizer
        for model in (nn.Linear(4, 4), nn.Linear(4, 4)):
            rt.setup(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
        row = rt.explain().optimizer
    assert row.value == "fused" and row.reason.startswith("model 1's AdamW: fused, ")
    assert "; model 2's AdamW: fused, " in row.reason


def test_an_implementation_the_user_set_is_not_timed(monkeypatch):
    def untimed(optimizer):
        raise AssertionError("timed an optimizer whose implementation the user set")

    monkeypatch.setattr(fused, "time_fused", untimed)
    model = nn.Linear(4, 2)
    with Runtime(RuntimeOptions(devices="cpu")) as rt:
        _, built = rt.setup(model, given := torch.optim.AdamW(model.parameters(), foreach=False))
        assert built is given
        assert rt.explain().optimizer.value == "as given" and "set by the user" in rt.explain().optimizer.reason


def counting_timer(monkeypatch, fused_ms: float = 0.3) -> list[int]:
    """Replace the timing with one that counts its calls; return the count."""
    calls: list[int] = []

    def timed(optimizer):
        calls.append(1)
        trained = sum(p.numel() for p in optimizer.param_groups[0]["params"] if p.requires_grad)
        return timing(1.0, fused_ms, timed=trained, of=trained)

    monkeypatch.setattr(fused, "time_fused", timed)
    return calls


def test_a_second_run_reads_the_timing_from_the_cache_and_the_plan_says_when_it_was_measured(monkeypatch):
    calls = counting_timer(monkeypatch)
    reasons = []
    for _ in range(2):
        model, optimizer = model_and_optimizer()
        with Runtime(RuntimeOptions(devices="cpu")) as rt:
            _, built = rt.setup(model, optimizer)
            reasons.append(rt.explain().optimizer.reason)
        assert built is not optimizer and built.defaults["fused"]
    assert calls == [1]  # timed once: the second run paid nothing
    assert "cached from" not in reasons[0]
    assert "(1.00 ms against" not in reasons[1] and "0.30 ms against 1.00 ms a step" in reasons[1]
    assert "parameters; cached from 20" in reasons[1]


def test_a_timing_taken_while_the_cpus_were_busy_decides_its_run_but_is_not_cached(monkeypatch):
    calls = counting_timer(monkeypatch)
    waited = [0.5]

    class FakeStalls:  # tasks waited for a CPU half the timing: another process's loop on one of two CPUs
        def start(self):
            return self

        def stop(self):
            return waited[0]

    monkeypatch.setattr(fused, "Stalls", FakeStalls)
    reasons = []
    for share in (0.5, 0.05, 0.05):
        waited[0] = share
        model, optimizer = model_and_optimizer()
        with Runtime(RuntimeOptions(devices="cpu")) as rt:
            _, built = rt.setup(model, optimizer)
            reasons.append(rt.explain().optimizer.reason)
        assert built.defaults["fused"]  # each run takes its own timing's verdict
    assert calls == [1, 1]  # the busy run's timing was not cached: the next run timed again, and cached its own
    assert reasons[0].endswith(
        "parameters; timed while the CPUs were busy (tasks waited for one 50% of the time), so not cached: the next "
        "run times it again)"
    )
    assert "busy" not in reasons[1] and "cached from" not in reasons[1] and "cached from" in reasons[2]


def test_the_cache_keys_what_a_step_takes_and_not_the_learning_rate(monkeypatch):
    calls = counting_timer(monkeypatch)

    def timed_once(optimizer: torch.optim.Optimizer, device=CPU) -> bool:
        before = len(calls)
        fused.timed_or_cached(optimizer, device)
        return len(calls) > before

    def adamw(model: nn.Module, **options) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), **{"lr": 1e-3, **options})

    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    assert timed_once(adamw(model))
    assert not timed_once(adamw(model, lr=0.5))  # a schedule moves it: the step takes as long
    assert timed_once(adamw(model, lr=torch.tensor(1e-3)))  # a tensor's step takes other kernels
    assert not timed_once(adamw(model, lr=torch.tensor(0.5)))
    assert not timed_once(adamw(nn.Linear(16, 4)))  # another model of the same shapes
    assert timed_once(adamw(model, amsgrad=True))  # an option the step reads
    assert timed_once(adamw(nn.Linear(16, 8)))  # other shapes
    assert timed_once(adamw(nn.Linear(16, 4).double()))  # another dtype
    assert timed_once(torch.optim.Adam(model.parameters(), lr=1e-3))  # another kind
    assert timed_once(adamw(model), CPU_AMX)  # another machine
    frozen = nn.Linear(16, 4)
    frozen.bias.requires_grad_(False)
    assert timed_once(adamw(frozen))  # other parameters train


def test_a_damaged_entry_is_timed_again_and_a_failed_timing_is_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    calls = counting_timer(monkeypatch)
    _, optimizer = model_and_optimizer()
    first = fused.timed_or_cached(optimizer, CPU)
    assert isinstance(first, StepTiming) and not first.cached_from and calls == [1]
    (entry,) = (tmp_path / fused.CACHED).iterdir()
    assert isinstance(fused.timed_or_cached(optimizer, CPU), StepTiming) and calls == [1]
    of = first.of

    def entry_of(*measured) -> str:
        return json.dumps({"measured_at": "2026-12-07 10:52 UTC", "measured": list(measured)})

    read = fused.timed_or_cached(optimizer, CPU)
    assert isinstance(read, StepTiming) and read.cached_from and calls == [1]
    entry.write_text(entry_of(0.002, 0.001, of, of), encoding="utf-8")  # a well-formed entry is read as it is
    assert fused.timed_or_cached(optimizer, CPU) == StepTiming(0.002, 0.001, of, of, "2026-12-07 10:52 UTC")
    damaged = [
        "[1.0, 0.3, 10, 10]",  # not the cache's form
        "not json",
        entry_of(0.001, -1.0, of, of),  # a step that took no time
        entry_of(0.001, float("nan"), of, of),
        entry_of(0.001, 0.002, of - 1, of - 1),  # another optimizer's count
        entry_of(0.001, 0.002, of + 1, of),  # more timed than it has
        entry_of(0.001, 0.002, True, of),
        entry_of(0.001, 0.002, of),
    ]
    for text in damaged:
        entry.write_text(text, encoding="utf-8")
        timed, before = fused.timed_or_cached(optimizer, CPU), len(calls)
        assert isinstance(timed, StepTiming) and not timed.cached_from, text  # timed again
        assert fused.timed_or_cached(optimizer, CPU).cached_from and len(calls) == before, text  # and written whole
    assert len(calls) == 1 + len(damaged)
    (entry,) = (tmp_path / fused.CACHED).iterdir()
    entry.unlink()
    monkeypatch.setattr(
        fused, "time_fused", lambda optimizer: calls.append(1) or "its fused kernel failed on a copy (x)"
    )
    assert fused.timed_or_cached(optimizer, CPU) == "its fused kernel failed on a copy (x)"
    assert fused.timed_or_cached(optimizer, CPU) == "its fused kernel failed on a copy (x)"
    assert len(calls) == 3 + len(damaged) and not any(
        (tmp_path / fused.CACHED).iterdir()
    )  # tried again, nothing cached


@pytest.mark.parametrize(("fused_ms", "deterministic", "expected"), [(0.3, False, True), (0.99, False, False),
                                                                      (0.3, True, False)])  # fmt: skip
def test_a_trials_copies_step_as_the_run_will(monkeypatch, fused_ms, deterministic, expected):
    calls = counting_timer(monkeypatch, fused_ms)
    model, _ = model_and_optimizer()
    here = probe_device(torch.device("cpu"))  # the machine the Runtime below sets up on: the cache's key holds it
    factory = fused.as_the_run_steps(
        lambda params: torch.optim.AdamW(params, lr=1e-3), model, here, sharded=False, deterministic=deterministic
    )
    built = [factory(model.parameters()) for _ in range(2)]  # a copy's optimizer is built again at each turn
    assert all(bool(b.defaults.get("fused")) == expected for b in built)
    assert calls == ([] if deterministic else [1])  # timed once, then read from the cache (which the run reads too)
    with Runtime(RuntimeOptions(devices="cpu", deterministic=deterministic)) as rt:
        _, run = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert bool(run.defaults.get("fused")) == expected and len(calls) == (0 if deterministic else 1)


def test_a_trials_copies_keep_what_the_run_keeps_untimed(monkeypatch):
    calls = counting_timer(monkeypatch)
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    as_given = [
        fused.as_the_run_steps(lambda p: torch.optim.SGD(p, lr=0.1), sparse, CPU, sharded=False, deterministic=False),
        fused.as_the_run_steps(
            lambda p: torch.optim.AdamW(p, foreach=False), nn.Linear(4, 2), CPU, sharded=False, deterministic=False
        ),
        fused.as_the_run_steps(torch.optim.AdamW, nn.Linear(4, 2), CPU, sharded=True, deterministic=False),
        fused.as_the_run_steps(torch.optim.AdamW, nn.Linear(4, 2), MPS, sharded=False, deterministic=False),
    ]
    for factory, model in zip(as_given, (sparse, nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(4, 2)), strict=True):
        assert not factory(model.parameters()).defaults.get("fused")
    assert calls == []
    assert fused.as_the_run_steps(lambda p: torch.optim.SGD(p, lr=0.1), nn.Linear(4, 2), H100, sharded=False,
                                  deterministic=False)(nn.Linear(4, 2).parameters()).defaults["fused"]  # fmt: skip
    not_one = fused.as_the_run_steps(lambda p: "an optimizer", nn.Linear(4, 2), CPU, sharded=False, deterministic=False)
    assert not_one(nn.Linear(4, 2).parameters()) == "an optimizer"  # refused where it is built, as the run refuses it


def test_the_trainers_trial_builds_its_copies_optimizers_as_the_run_will(monkeypatch):
    from torch.utils.data import TensorDataset

    import redline.runtime.measure as measure
    from redline.parallel.env import DistEnv
    from redline.runtime.trial import Measured
    from redline.task import Task

    monkeypatch.setenv("REDLINE_CPU", "amx")
    counting_timer(monkeypatch)
    seen = []

    def fake_trial(model, optimizer, loss_fn, batch, device, candidates, **_):
        seen.append(optimizer(model.parameters()).defaults.get("fused"))
        return [Measured("fp32", (0.01,) * 3, (1.0,)), Measured("bf16-mixed", (0.007,) * 3, (1.0,))]

    monkeypatch.setattr(measure, "run_trial", fake_trial)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    task = Task(model=lambda: nn.Linear(8, 1), loss_fn=nn.functional.mse_loss, train_data=data, batch_size=16)
    for deterministic in (False, True):
        options = RuntimeOptions(devices="cpu", deterministic=deterministic)
        measure.measure_auto(task, options, 16, 5000, DistEnv(), trial="fresh")
    assert seen == [True, None]


def test_a_trials_copies_take_the_first_builds_decision_even_where_no_timing_was_cached(monkeypatch):
    calls = []
    monkeypatch.setattr(fused, "time_fused", lambda optimizer: calls.append(1) or "its fused kernel failed (x)")
    model = nn.Linear(4, 2)
    factory = fused.as_the_run_steps(torch.optim.AdamW, model, CPU, sharded=False, deterministic=False)
    assert not any(factory(model.parameters()).defaults.get("fused") for _ in range(3))
    assert calls == [1]  # a copy's optimizer is built at every turn: the failed timing is not taken again each time


def late_start_run(
    optimizer_factory, *, precision: str = "fp32", bias_trains: bool = False
) -> tuple[torch.Tensor, str]:
    """Six steps of an MLP whose first layer (its weight alone, with ``bias_trains``) is frozen until step 4 (the same
    optimizer): its weights, and the Plan's optimizer row."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model[0].requires_grad_(False)
    model[0].bias.requires_grad_(bias_trains)
    batches = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(6)]
    with Runtime(RuntimeOptions(devices="cpu", precision=precision)) as rt:
        model, optimizer = rt.setup(model, optimizer_factory)
        for i, (x, y) in enumerate(batches):
            if i == 3:  # unfrozen: its first gradient comes after the optimizer's first step
                model[0].requires_grad_(True)
            with rt.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            rt.backward(loss)
            rt.step(optimizer)
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        return weights, rt.explain().optimizer.reason


def test_a_fused_sgd_meeting_a_parameters_late_first_gradient_steps_as_given_from_there(monkeypatch, caplog):
    """torch's fused SGD with momentum raised a bare TypeError where a layer was unfrozen mid-run (plain PyTorch's
    for-loop SGD takes it): the Runtime had rebuilt it fused, unasked, where its timing said faster."""
    counting_timer(monkeypatch)  # fused timed faster: the Runtime rebuilds the SGD fused

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    weights, reason = late_start_run(sgd)
    assert reason.startswith("SGD: stepped as given from a step where a parameter got its first gradient after")
    assert "pass fused=False to step it so from the start" in caplog.text
    as_given, _ = late_start_run(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=False))
    torch.testing.assert_close(weights, as_given)  # the same numbers as the for-loop run from the start
    asked, _ = late_start_run(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True))
    torch.testing.assert_close(asked, as_given)  # a fused SGD the user asked for is stepped so too, and says so


def test_under_fp16_the_fallback_leaves_the_scaler_nothing_of_the_fused_step():
    """fp16's scaler hands a fused step its scale on the optimizer: a step as given would read it and refuse."""
    asked, reason = late_start_run(
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True), precision="fp16-mixed"
    )
    as_given, _ = late_start_run(
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=False), precision="fp16-mixed"
    )
    assert reason.startswith("SGD: stepped as given from a step")
    torch.testing.assert_close(asked, as_given)


def test_another_type_error_of_a_step_is_not_taken_for_a_late_gradient():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)

    def broken() -> None:
        raise TypeError("unsupported operand type(s)")

    with pytest.raises(TypeError, match="unsupported operand"):
        fused.step_unfusing(optimizer, broken)
    assert optimizer.param_groups[0]["fused"] and fused.unfused(optimizer) is None


def test_a_late_gradient_in_a_later_group_leaves_the_groups_before_it_stepped_once(monkeypatch):
    """Caught after torch's refusal, a fallback stepped again the groups the fused kernel had stepped before it: a head
    group, then a backbone group whose bias trains and whose weight is unfrozen later."""

    def grouped(fused: bool | None):
        def build(params):
            params = list(params)  # the first layer's weight and bias, then the head's
            groups = [{"params": params[2:]}, {"params": params[:2]}]
            return torch.optim.SGD(groups, lr=0.1, momentum=0.9, **({} if fused is None else {"fused": fused}))

        return build

    asked, reason = late_start_run(grouped(True), bias_trains=True)
    as_given, _ = late_start_run(grouped(False), bias_trains=True)
    assert reason.startswith("SGD: stepped as given from a step")
    torch.testing.assert_close(asked, as_given)


def test_a_checkpoint_saved_after_the_fallback_loads_into_a_fused_optimizer_that_steps_under_fp16(tmp_path):
    """torch's load copied the saved fused=False into the new fused SGD's groups, which then stepped as given while
    fp16's scaler handed them a fused step's scale: AssertionError at the first step after the resume."""

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model[0].requires_grad_(False)
    x, y = torch.randn(4, 8), torch.randn(4, 2)

    def steps(rt, model, optimizer, count):
        for _ in range(count):
            with rt.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            rt.backward(loss)
            rt.step(optimizer)

    with Runtime(RuntimeOptions(devices="cpu", precision="fp16-mixed")) as rt:
        model, optimizer = rt.setup(model, sgd)
        steps(rt, model, optimizer, 2)
        model[0].requires_grad_(True)
        steps(rt, model, optimizer, 2)  # the fallback
        assert not optimizer.param_groups[0]["fused"]
        rt.save(tmp_path / "step-00000004", step=4)
    torch.manual_seed(0)
    again = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with Runtime(RuntimeOptions(devices="cpu", precision="fp16-mixed")) as rt:
        again, resumed = rt.setup(again, sgd)
        rt.load(tmp_path / "step-00000004")
        assert resumed.param_groups[0]["fused"]  # this run's implementation, not the checkpoint's
        steps(rt, again, resumed, 2)  # every parameter has its buffer: the fused kernel takes them


def test_a_load_into_an_optimizer_stepping_otherwise_than_the_checkpoints_run_says_so(monkeypatch, caplog, tmp_path):
    """A loop of one's own resumed with rt.load stepped the kernel a timing picked now (on a busy machine, the
    other one), with no word: the two round differently, and the resumed run did not end as the unbroken one."""

    def run(fused_ms: float, load: bool, **user: bool) -> None:
        monkeypatch.setattr(fused, "time_fused", lambda optimizer: timing(1.0, fused_ms))
        with Runtime(RuntimeOptions(devices="cpu")) as rt:
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
            model, optimizer = rt.setup(net, lambda params: torch.optim.AdamW(params, lr=1e-3, **user))
            if load:
                rt.load(tmp_path / "ckpt")
                return
            rt.backward(model(torch.randn(8, 16)).square().mean())
            rt.step(optimizer)
            rt.save(tmp_path / "ckpt")

    run(0.3, load=False)  # fused by the timing
    for quiet in ({"fused_ms": 0.3}, {"fused_ms": 0.99, "fused": True}):  # fused again: by timing, or by the user
        with caplog.at_level("WARNING", logger="redline"):
            run(load=True, **quiet)
        assert "round differently" not in caplog.text, quiet
    with caplog.at_level("WARNING", logger="redline"):
        run(0.99, load=True)
    assert "ckpt: its run stepped AdamW fused, and this run steps it unfused (as given: " in caplog.text
    assert "hint: to resume it exactly, build the optimizer with fused=True, as that run did" in caplog.text
    caplog.clear()
    run(0.3, load=False, fused=False)  # the user's unfused, loaded where the timing picks fused
    with caplog.at_level("WARNING", logger="redline"):
        run(0.3, load=True)
    assert "its run stepped AdamW unfused, and this run steps it fused (fused: " in caplog.text
    assert "build the optimizer with fused=False" in caplog.text
