"""The attention kernel: resolved into the Plan, applied for the run's process and put back, found from the model's own
calls, searched by `redline tune`, kept by a tuned Plan and a resumed run."""

import json
import threading
import types

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.bench import tune as tune_module
from redline.bench.tune import search_space, skipped_axes, tune
from redline.errors import ConfigError
from redline.examples.gpt import GPT, GPTConfig
from redline.hardware.device import DeviceFacts, probe_device
from redline.memory.fit import fit_choices
from redline.parallel.env import DistEnv
from redline.plan.attention import resolve_attention
from redline.runtime import attention as attention_module
from redline.runtime import attention_mode, kernel_check, measure
from redline.runtime.attention import (
    attention_calls,
    attention_kernels,
    kernels_taking,
    model_attention,
    time_kernels,
    torch_pick,
)
from redline.runtime.compile_check import EAGER_END, PHASE
from redline.runtime.measure import measure_auto, recall_auto
from redline.runtime.options import RuntimeOptions
from redline.runtime.runtime import Runtime
from redline.runtime.settings import ProcessSettings
from redline.runtime.stopwatch import StepTimer, Stopwatch
from redline.runtime.trial import Measured, form, form_parts, run_trial
from redline.runtime.tuned import Candidate, Trial, TunedPlan, store_tuned
from redline.task import Task

CPU = DeviceFacts(type="cpu", name="Xeon", cpu_isa="amx", cpu_count=8)
H100 = DeviceFacts(type="cuda", name="NVIDIA H100 80GB HBM3", index=0, capability=(9, 0), cpu_count=16)
T4 = DeviceFacts(type="cuda", name="Tesla T4", index=0, capability=(7, 5), cpu_count=8)
MPS = DeviceFacts(type="mps", name="Apple M2")
HERE = torch.device("cpu")


def small_gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=dropout))


def gpt_task() -> Task:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (64, 17), generator=generator)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return Task(model=small_gpt, loss_fn=loss, train_data=data, batch_size=8, name="gpt")


def flags() -> tuple[bool, bool, bool, bool, list[int]]:
    cuda = torch.backends.cuda
    order = torch._C._get_sdp_priority_order() if hasattr(torch._C, "_get_sdp_priority_order") else []
    return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled(), list(order))  # fmt: skip


def test_auto_leaves_torchs_pick_per_call_and_a_kernel_named_is_checked_against_the_device():
    assert resolve_attention("auto", H100).value == "default"
    assert "flash for fp16/bf16 without a mask" in resolve_attention("auto", H100).reason
    assert resolve_attention("auto", CPU).reason.startswith("auto: torch picks per call: its CPU flash kernel")
    assert str(resolve_attention("cudnn", H100)) == "cudnn: requested: cudnn for every call it takes, math for the rest"
    assert resolve_attention("math", CPU).reason == "requested: math for every call"
    with pytest.raises(
        ConfigError, match=r"attention='flashy' is not allowed; .*\nhint: did you mean attention='flash'"
    ):
        resolve_attention("flashy", CPU)  # the kernels were named, without the one meant
    with pytest.raises(ConfigError, match=r"(?s)attention='efficient' is not allowed; expected 'auto', 'flash' or "
                       r"'math' on a CPU\nhint: .*efficient is a CUDA kernel"):  # fmt: skip
        resolve_attention("efficient", CPU)
    with pytest.raises(ConfigError, match=r"(?s)on Tesla T4 \(sm75\).*needs an Ampere or newer GPU"):
        resolve_attention("flash", T4)
    assert resolve_attention("efficient", T4).value == "efficient"
    with pytest.raises(ConfigError, match="'auto' on mps"):
        resolve_attention("math", MPS)
    with pytest.raises(ConfigError, match="attention='fast' is not allowed; expected one of"):
        RuntimeOptions(attention="fast")  # type: ignore[arg-type]


def test_a_kernel_is_set_for_the_process_while_the_settings_last_and_torchs_flags_come_back():
    before = flags()
    with ProcessSettings(attention="math").enter():
        assert flags()[:4] == (False, False, True, False)
        call = attention_calls(small_gpt(), torch.randint(0, 32, (2, 16)))[0]
        assert torch_pick(call, HERE) == "math"
    assert flags() == before
    with ProcessSettings(attention="flash").enter():
        assert flags()[0] and flags()[2] and torch_pick(call, HERE) == "flash"  # math stays for what flash cannot take
    assert flags() == before and torch_pick(call, HERE) == "flash"  # torch's own pick on a CPU


def test_the_runtime_plans_and_applies_the_kernel_and_leaves_torchs_choice_where_it_closes():
    before = flags()
    with Runtime(devices="cpu", attention="math") as rt:
        rt.setup(small_gpt(), lambda params: torch.optim.SGD(params, lr=0.1))
        assert rt.explain().attention.value == "math" and flags()[0] is False
    assert flags() == before
    with Runtime(devices="cpu") as rt:
        assert rt.explain().attention.value == "default" and flags() == before  # auto changes nothing


def test_a_models_attention_calls_are_found_with_the_kernels_that_take_them():
    calls = attention_calls(small_gpt(), torch.randint(0, 32, (2, 16)))
    assert len(calls) == 1  # the one layer's call
    call = calls[0]
    assert call.shapes[0] == (2, 2, 16, 8) and call.is_causal and call.dropout_p == 0.0 and call.mask is None
    assert kernels_taking(calls, HERE) == ["flash", "math"]  # efficient and cuDNN are CUDA's
    assert attention_kernels(calls, "cpu", "fp32") == ["math"]  # flash is torch's own pick on a CPU
    dropping = attention_calls(small_gpt(dropout=0.1).train(), torch.randint(0, 32, (2, 16)))
    assert dropping[0].dropout_p == 0.1 and kernels_taking(dropping, HERE) == ["math"]  # CPU flash has no dropout
    assert attention_kernels(dropping, "cpu", "fp32") == []  # math is what torch picks already
    assert attention_calls(nn.Linear(4, 2), torch.randn(2, 4)) == []


def test_the_tune_searches_the_kernels_only_for_a_model_that_calls_attention():
    task = gpt_task()
    calls = model_attention(task, "cpu")
    assert calls and calls[0].shapes[0][0] == 8  # a batch of the task's data at its batch size
    assert dict(search_space(task, CPU, calls=calls))["attention"] == ["auto", "flash", "math"]
    assert dict(search_space(task, H100, calls=calls))["attention"] == ["auto", "flash", "efficient", "cudnn", "math"]
    assert skipped_axes(task, CPU)["attention"].startswith("the model made no call to F.scaled_dot_product_attention")
    assert skipped_axes(task, MPS, calls=calls)["attention"] == "torch picks the attention kernel on mps"


def test_tune_times_the_kernels_that_take_the_calls_and_a_tuned_run_prefers_the_winner(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        "redline.bench.tune.search_space", lambda task, facts, **_: [("attention", ["auto", "flash", "math"])]
    )
    task = gpt_task()
    tuned, _ = tune(task, devices="cpu", budget_s=60, planned_steps=100, steps=4, window=2)
    tried = [t.candidate.attention for t in tuned.trials]
    assert tried == ["auto", "math"]  # flash is torch's pick here: timing it again would time "auto" twice
    assert all(t.step_s is not None and not t.rejected for t in tuned.trials)
    reason = tuned.reasons["attention"]
    assert "fp32, eager: " in reason and "fp32, eager, math attention: " in reason
    assert reason.startswith(("torch's pick of attention kernel kept", "math attention, "))
    # A tuned Plan whose best kernel is math: the run prefers it for the whole process, and says so.
    best = Candidate(attention="math")
    plan = TunedPlan(
        task="gpt",
        device="cpu",
        batch_size=8,
        planned_steps=100,
        measured_at="2026-12-05 01:00 UTC",
        best=best,
        reasons={"attention": "math attention, 1.20x less time"},
        trials=(Trial(best, 0.01),),
    )
    store_tuned(task.fingerprint(), probe_device(HERE), plan, model=task.build_model())  # fmt: skip
    before = flags()
    with Runtime(devices="cpu", plan="tuned") as rt:
        rt.setup(task.build_model(), task.optimizer)
        chosen = rt.explain().attention
        assert flags()[0] is False  # flash off: math runs every call
    assert chosen.value == "math" and chosen.reason.startswith("tuned 2026-12-05 01:00 UTC at batch 8 for 100 steps")
    assert chosen.reason.endswith("math attention, 1.20x less time")
    assert flags() == before


def test_a_tune_cached_before_the_kernel_was_searched_leaves_it_to_auto():
    data = TunedPlan(task="t", device="cpu", batch_size=8, planned_steps=10, measured_at="then", best=Candidate(),
                     reasons={}, trials=()).to_dict()  # fmt: skip
    del data["best"]["attention"]
    old = TunedPlan.from_dict(json.loads(json.dumps(data)))
    assert "attention" in old.unmeasured and old.apply(RuntimeOptions()).attention == "auto"


def test_a_resumed_run_keeps_the_kernel_its_plan_ran_and_names_one_asked_for_now():
    from redline.train.resume import overridden_requests

    plan = {"attention": {"value": "math", "reason": "requested: math for every call"}}
    assert RuntimeOptions().with_plan(_full(plan)).attention == "math"
    assert RuntimeOptions(attention="flash").with_plan(_full({"attention": {"value": "default"}})).attention == "auto"
    assert RuntimeOptions(attention="flash").with_plan(_full({})).attention == "flash"  # a Plan from before the axis
    assert overridden_requests(RuntimeOptions(attention="flash"), plan) == [
        "--attention flash asked, the checkpoint's math kept"
    ]


def _full(extra: dict) -> dict:
    plan = {
        "device": {"value": "cpu"}, "precision": {"value": "fp32"}, "compile": {"value": False},
        "channels_last": {"value": False}, "grad_accum": {"value": 1}, "clip_grad_norm": {"value": None},
    }  # fmt: skip
    return {**plan, **extra}


# -- the precision trial times each reduced precision with the kernels that take the model's calls ---------------


def test_a_trial_form_names_its_precision_and_the_kernel_its_steps_prefer():
    assert form("bf16-mixed") == "bf16-mixed" and form("bf16-mixed", "math") == "bf16-mixed with math attention"
    assert form_parts("bf16-mixed with math attention") == ("bf16-mixed", "math")
    assert form_parts("fp16-mixed") == ("fp16-mixed", "auto")


@pytest.fixture
def math_wins(tmp_path, monkeypatch):
    """Plan as on an AMX CPU; each trial times bf16 at 1.1x fp32's step and bf16 with math attention at 0.7x."""
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("REDLINE_CPU", "amx")
    asked = []

    def fake_trial(model, optimizer, loss_fn, batch, device, candidates, **_):
        asked.append(list(candidates))
        steps = {"fp32": 10.0, "bf16-mixed": 11.0, "bf16-mixed with math attention": 7.0}
        return [Measured(name, (steps[name] / 1e3,) * 12, (2.0, 1.8)) for name in ("fp32", *candidates)]

    monkeypatch.setattr(measure, "run_trial", fake_trial)
    return asked


def test_the_trial_measures_a_precision_with_the_kernels_of_the_models_attention_and_the_run_takes_both(math_wins):
    found = measure_auto(gpt_task(), RuntimeOptions(devices="cpu"), 8, 5000, DistEnv(), trial="auto")
    assert math_wins == [["bf16-mixed", "bf16-mixed with math attention"]]  # the CPU flash kernel is torch's pick
    assert found["precision"].value == "bf16-mixed" and found["attention"].value == "math"
    assert found["attention"].reason.startswith("measured: bf16-mixed with math attention ran 1.43x fp32")
    before = flags()
    with Runtime(devices="cpu", measured=found) as rt:
        plan = rt.explain()
        assert (plan.precision.value, plan.attention.value) == ("bf16-mixed", "math") and flags()[0] is False
    assert flags() == before
    again = measure_auto(gpt_task(), RuntimeOptions(devices="cpu"), 8, 5000, DistEnv(), trial="auto")
    assert len(math_wins) == 1  # read from the cache, kernel and all
    assert again["attention"].value == "math" and "cached from" in again["attention"].reason
    recalled = recall_auto(gpt_task(), RuntimeOptions(devices="cpu"), 8, DistEnv())  # as `redline memory` reads it
    assert (recalled["precision"].value, recalled["attention"].value) == ("bf16-mixed", "math")
    memory_cpu = probe_device(HERE)
    weighing = fit_choices(gpt_task(), "auto", "auto", memory_cpu, here=True, batch_size=8)
    assert (weighing.precision.value, weighing.attention.value) == ("bf16-mixed", "math")
    assert "cached from" in weighing.attention.reason
    assert fit_choices(gpt_task(), "auto", "auto", H100, here=False, batch_size=8).attention.value == "auto"
    assert len(math_wins) == 1  # an estimate runs no trial


def test_no_kernel_is_timed_for_a_model_without_attention_or_one_whose_kernel_is_given(math_wins):
    mlp = Task(model=lambda: nn.Linear(16, 32), loss_fn=nn.functional.mse_loss,
               train_data=TensorDataset(torch.randn(32, 16), torch.randn(32, 32)), batch_size=8)  # fmt: skip
    assert set(measure_auto(mlp, RuntimeOptions(devices="cpu"), 8, 5000, DistEnv(), trial="auto")) == {"precision"}
    given = RuntimeOptions(devices="cpu", attention="flash")
    assert set(measure_auto(gpt_task(), given, 8, 5000, DistEnv(), trial="auto")) == {"precision"}
    assert math_wins == [["bf16-mixed"], ["bf16-mixed"]]


def test_a_trial_step_prefers_its_kernel_and_leaves_torchs_flags_as_they_were():
    task, before, seen = gpt_task(), flags(), []

    class Watching(GPT):
        def forward(self, idx, targets=None):
            seen.append(flags()[0])  # whether flash is enabled while the step runs
            return super().forward(idx)

    model = Watching(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16))
    batch = next(iter(torch.utils.data.DataLoader(task.train_data, batch_size=8)))
    found = run_trial(model, task.optimizer, task.loss_fn, batch, HERE, ["fp32 with math attention"], rounds=1,
                      stop_early=False)  # fmt: skip
    assert {m.precision for m in found} == {"fp32", "fp32 with math attention"} and not any(m.rejected for m in found)
    assert True in seen and False in seen and flags() == before


def test_the_tunes_precision_axis_tries_a_reduced_precision_with_each_kernel_too(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("REDLINE_CPU", "amx")  # bf16 is a candidate
    space = [("precision", ["fp32", "bf16-mixed"]), ("attention", ["auto", "flash", "math"])]
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    tuned, _ = tune(gpt_task(), devices="cpu", budget_s=60, planned_steps=100, steps=2, window=1)
    tried = [(t.candidate.precision, t.candidate.attention) for t in tuned.trials]
    assert tried[:3] == [("fp32", "auto"), ("bf16-mixed", "auto"), ("bf16-mixed", "math")]
    assert "bf16-mixed, eager, math attention: " in tuned.reasons["precision"]
    (first, _), (second, _) = tried[3:]  # the kernels then, in the precision kept: its own pick and math (flash is it)
    assert first == second and {a for _, a in tried[3:]} == {"auto", "math"}


def test_a_kernel_preferred_tags_torch_compiles_cache_keys_so_no_graph_of_another_kernel_is_served():
    # torch's compile caches do not key on the kernel flags: a graph compiled under math attention was served, from
    # disk, to a later process that asked for flash. The tag keeps each kernel's graphs apart, and comes off after.
    config = torch.compiler.config
    before = config.cache_key_tag
    with ProcessSettings(attention="math").enter():
        assert config.cache_key_tag.endswith("redline attention=math")
    assert config.cache_key_tag == before


# -- what the reviews found ------------------------------------------------------------------------------------


def test_a_kernel_named_runs_in_every_step_of_the_trial_and_keys_its_own_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("REDLINE_CPU", "amx")
    seen = []

    def fake_trial(model, optimizer, loss_fn, batch, device, candidates, **_):
        seen.append((list(candidates), flags()[0]))  # flash enabled while the trial runs?
        return [Measured(name, (0.01,) * 12, (2.0, 1.8)) for name in ("fp32", *candidates)]

    monkeypatch.setattr(measure, "run_trial", fake_trial)
    for kernel in ("math", "flash", "math"):  # the third reads the first's entry
        measure_auto(gpt_task(), RuntimeOptions(devices="cpu", attention=kernel), 8, 5000, DistEnv(), trial="auto")
    assert seen == [(["bf16-mixed"], False), (["bf16-mixed"], True)]


def test_the_trial_looks_for_kernels_only_when_it_measures_and_leaves_a_shared_model_where_it_was(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("REDLINE_CPU", "amx")
    asked = []
    monkeypatch.setattr(measure, "run_trial", lambda *args, **_: asked.append(list(args[5])) or [
        Measured(name, (0.01,) * 12, (2.0, 1.8)) for name in ("fp32", *args[5])
    ])  # fmt: skip
    net, built = small_gpt().eval(), []  # a module the factory keeps and hands out, in the mode its owner left it
    shared = Task(model=lambda: built.append(1) or net, loss_fn=gpt_task().loss_fn, train_data=gpt_task().train_data,
                  batch_size=8)  # fmt: skip
    assert set(measure_auto(shared, RuntimeOptions(devices="cpu"), 8, 5000, DistEnv(), trial="off")) == {"precision"}
    assert built == []  # the trial off: nothing built, nothing run
    found = measure_auto(shared, RuntimeOptions(devices="cpu"), 8, 5000, DistEnv(), trial="auto")
    assert asked == [["bf16-mixed", "bf16-mixed with math attention"]] and found["attention"].value == "default"
    assert all(p.device.type == "cpu" for p in net.parameters()) and not net.training  # not moved, nor trained
    # A run that repays the precisions but not every kernel in whole steps: tests/unit/test_trial_kernels.py


def test_calls_through_a_wrapped_attention_function_are_still_seen(monkeypatch):
    original = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: original(*a, **k))
    assert len(attention_calls(small_gpt(), torch.randint(0, 32, (2, 16)))) == 1


def test_torchs_kernel_order_comes_back_as_it_was_with_a_kernel_turned_off_before():
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    if order is None:
        pytest.skip("this torch keeps no kernel order")
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        before = flags()
        with ProcessSettings(attention="math").enter():
            pass
        assert flags() == before
    finally:
        torch.backends.cuda.enable_flash_sdp(True)


def test_a_tuned_kernel_stays_with_its_precision():
    best = Candidate(precision="bf16-mixed", attention="math")
    plan = TunedPlan(task="t", device="cpu", batch_size=8, planned_steps=10, measured_at="then", best=best,
                     reasons={}, trials=(), unmeasured=())  # fmt: skip
    assert plan.apply(RuntimeOptions()).attention == "math"
    assert plan.apply(RuntimeOptions(precision="fp32")).attention == "auto"  # tuned for bf16-mixed, not for fp32
    unmeasured, reasons = ["attention"], {"attention": "not measured: the budget was spent; left to the run's auto"}
    tune_module._kernel_with_precision(best, unmeasured, reasons)
    assert unmeasured == [] and reasons["attention"].startswith("math attention, timed with bf16-mixed")


def test_a_run_resumed_on_another_kind_of_device_takes_the_kernel_asked_now():
    from redline.train.resume import overridden_requests

    stored = _full({"attention": {"value": "efficient"}, "device": {"value": "cuda:0"}})
    assert RuntimeOptions(devices="cpu").with_plan(stored).attention == "auto"
    assert RuntimeOptions(devices="cuda:1").with_plan(stored).attention == "efficient"
    assert overridden_requests(RuntimeOptions(devices="cpu", attention="math"), stored) == []
    default = _full({"attention": {"value": "default"}})
    assert overridden_requests(RuntimeOptions(attention="math"), default) == [
        "--attention math asked, the checkpoint's auto kept"
    ]


def test_a_tuned_plan_with_a_kernel_asked_for_too_enters_it_once(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    task = gpt_task()
    plan = TunedPlan(task="gpt", device="cpu", batch_size=8, planned_steps=100, measured_at="then",
                     best=Candidate(attention="math"), reasons={}, trials=())  # fmt: skip
    store_tuned(task.fingerprint(), probe_device(HERE), plan, model=task.build_model())
    with Runtime(devices="cpu", plan="tuned", attention="math") as rt:
        rt.setup(task.build_model(), task.optimizer)
        assert torch.compiler.config.cache_key_tag == "redline attention=math"


# -- a Runtime in the user's own loop: the precision check's bf16 phase times the kernels ----------------------


def loop(rt: Runtime, steps: int, costs: dict[str, float], kernel_costs: dict[str, float] | None = None) -> list[bool]:
    """Train the small GPT ``steps`` steps in a loop of the user's, each step costing ``costs[precision]`` on the
    check's clock (bf16-mixed's times ``kernel_costs[kernel]``); whether flash was enabled at each step."""
    model, optimizer = rt.setup(small_gpt(), lambda params: torch.optim.SGD(params, lr=0.01))
    now = [0.0]
    if rt._compile_check is not None:
        rt._compile_check.timer.stopwatch.clock = lambda: now[0]
    tokens, flash = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(0)), []
    for _ in range(steps):
        with rt.autocast():
            loss = nn.functional.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
        rt.backward(loss)
        flash.append(flags()[0])
        kernel = "flash" if flags()[0] else "math"
        now[0] += costs[rt.precision.name] * (
            (kernel_costs or {}).get(kernel, 1.0) if rt.precision.name != "fp32" else 1
        )
        rt.step(optimizer)
    return flash


@pytest.fixture
def kernel_times(monkeypatch):
    """Plan as on an AMX CPU; the kernel check's own timing gives math ``times["math"]`` s and torch's pick 0.02 s."""
    monkeypatch.setenv("REDLINE_CPU", "amx")
    times = {"math": 0.01}

    def timed(calls, device, kernels, **_):
        return {k: times.get(k, 0.02) if k is not None else 0.02 for k in kernels}

    monkeypatch.setattr(kernel_check, "time_kernels", timed)
    return times


def test_a_user_loops_bf16_phase_runs_the_kernel_its_calls_ran_fastest_and_keeps_it_with_bf16(kernel_times):
    before = flags()
    with Runtime(devices="cpu", compile="off") as rt:
        flash = loop(rt, EAGER_END + PHASE + 3, {"fp32": 0.004, "bf16-mixed": 0.004}, {"math": 0.6, "flash": 1.0})
        plan = rt.explain()
        assert flash == [True] * EAGER_END + [False] * (PHASE + 3)  # math from the bf16 phase's first step on
    assert (plan.precision.value, plan.attention.value) == ("bf16-mixed", "math")
    assert plan.attention.reason.startswith(
        "measured on this run: math ran 2.00x torch's pick (the model's attention calls (1) "
    )
    assert flags() == before  # closed: torch's flags back


def test_a_paused_runtime_gives_torchs_flags_back_and_prefers_its_kernel_again_when_it_runs(kernel_times):
    before = flags()
    rt = Runtime(devices="cpu", compile="off")
    with rt:
        loop(rt, EAGER_END + PHASE + 3, {"fp32": 0.004, "bf16-mixed": 0.004}, {"math": 0.6, "flash": 1.0})
        assert flags()[0] is False  # math preferred
        rt.pause()  # another Runtime's turn (a bench's rows) runs with torch's own flags
        assert flags() == before
        with rt.turn():
            assert flags()[0] is False
        assert flags() == before
        rt.start()
        with rt.turn():  # a turn inside a running Runtime leaves its kernel on
            pass
        assert flags()[0] is False and rt.explain().attention.value == "math"
    assert flags() == before  # closed: torch's flags back for good, and the Plan still says what the run ran
    assert rt.explain().attention.value == "math"


def test_a_kernel_timed_in_bf16_is_dropped_with_it_and_one_not_faster_is_never_taken(kernel_times):
    with Runtime(devices="cpu", compile="off") as rt:  # bf16 loses whatever the kernel: fp32 stays, flash comes back
        flash = loop(rt, EAGER_END + PHASE + 3, {"fp32": 0.004, "bf16-mixed": 0.008})
        attention = rt.explain().attention
    assert flash[-1] is True and attention.value == "default" and attention.reason.endswith("but fp32 stays")
    kernel_times["math"] = 0.019  # within KEEP of torch's pick
    with Runtime(devices="cpu", compile="off") as rt:
        flash = loop(rt, EAGER_END + PHASE + 3, {"fp32": 0.004, "bf16-mixed": 0.002})
        attention = rt.explain().attention
    assert all(flash) and attention.value == "default" and "measured on this run, torch's pick kept" in attention.reason
    with Runtime(devices="cpu", compile="off", attention="flash") as rt:  # a kernel named is not checked
        assert rt._kernels is None or rt._kernels.chosen is None


def test_the_kernels_are_timed_on_the_calls_shapes_and_leave_the_random_streams_and_flags_as_they_were():
    calls = attention_calls(small_gpt(), torch.randint(0, 32, (2, 16)))
    state, before = torch.random.get_rng_state(), flags()
    timed = time_kernels(calls * 2, HERE, [None, "math"], repeats=1)
    assert set(timed) == {None, "math"} and all(t > 0 for t in timed.values())
    assert torch.equal(torch.random.get_rng_state(), state) and flags() == before


def test_kernels_that_cannot_be_timed_leave_torchs_pick_and_the_users_step_runs(kernel_times, monkeypatch):
    def broken(*_, **__):
        raise RuntimeError("out of memory while timing (made up by the test)")

    monkeypatch.setattr(kernel_check, "time_kernels", broken)
    with Runtime(devices="cpu", compile="off") as rt:
        flash = loop(rt, EAGER_END + 3, {"fp32": 0.004, "bf16-mixed": 0.002})
        attention = rt.explain().attention
    assert all(flash) and attention.value == "default"
    assert "the kernels could not be timed (RuntimeError: out of memory while timing" in attention.reason


def test_a_loop_that_sets_its_own_kernels_around_each_forward_gets_torchs_flags_back_as_they_were(kernel_times):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before = flags()
    with Runtime(devices="cpu", compile="off") as rt:
        model, optimizer = rt.setup(small_gpt(), lambda params: torch.optim.SGD(params, lr=0.01))
        tokens = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(0))
        for _ in range(EAGER_END + 3):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], set_priority=True), rt.autocast():
                loss = model(tokens[:, :-1]).float().square().mean()
            rt.backward(loss)
            rt.step(optimizer)
    assert flags() == before  # the kernel entered inside the loop's context is not put back over what it left


def test_math_is_left_out_where_the_attention_weights_it_keeps_would_not_fit(monkeypatch):
    calls = attention_calls(small_gpt(), torch.randint(0, 32, (2, 16)))  # 2 x 2 heads x 16 x 16 weights, fp32
    assert attention_module.math_fits(calls, HERE)
    monkeypatch.setattr(attention_module, "_free_bytes", lambda device: 4 * 2 * (2 * 2 * 16 * 16 * 4) - 1)
    assert not attention_module.math_fits(calls, HERE) and attention_kernels(calls, "cpu", "fp32") == []


def test_each_distinct_call_is_timed_once_a_pass_and_a_kernel_far_slower_stops_after_its_first(monkeypatch):
    now = [0.0]  # a fake clock that only the calls move: a loaded machine's real sleeps overran and broke the ratio
    ran: list[bool] = []

    def run(call, device):
        ran.append(flags()[0])  # flash on: torch's pick; off: math
        now[0] += 0.001 if flags()[0] else 0.03

    monkeypatch.setattr(attention_module, "_run", run)
    monkeypatch.setattr(attention_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    call = attention_calls(small_gpt(), torch.randint(0, 32, (2, 16)))[0]
    timed = time_kernels([call] * 6, HERE, [None, "math"], repeats=2)
    assert ran == [True] * 3 + [False]  # three passes of the one distinct call, then math's first, too slow to go on
    assert timed == {None: pytest.approx(6 * 0.001), "math": pytest.approx(6 * 0.03)}  # a pass counts the call 6 times


def test_no_pass_of_the_kernels_timing_starts_that_would_end_past_its_budget(monkeypatch):
    now, ran = [0.0], []

    def run(call, device):  # each call takes 20 ms on the timing's clock
        ran.append(flags()[0])
        now[0] += 0.02

    monkeypatch.setattr(attention_module, "_run", run)
    monkeypatch.setattr(attention_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    call = attention_calls(small_gpt(), torch.randint(0, 32, (2, 16)))[0]
    timed = time_kernels([call], HERE, [None, "math"], repeats=3, budget_s=0.07)
    assert list(timed) == [None] and ran == [True] * 3  # warm-up and two passes of torch's pick: a third, or math's
    assert now[0] <= 0.07  # first, would have ended past the budget
    ran.clear()
    timed = time_kernels([call], HERE, [None, "math"], repeats=1)  # no budget: every kernel, every pass
    assert list(timed) == [None, "math"] and ran == [True, True, False, False]


def test_the_kernel_check_gets_what_the_precision_block_leaves_of_the_allowance_and_says_when_it_ran_out(
    kernel_times, monkeypatch
):
    with Runtime(devices="cpu", compile="off") as rt:  # eager steps of 4 ms: a bf16 block costs up to 0.056 s more
        loop(rt, EAGER_END + 1, {"fp32": 0.004, "bf16-mixed": 0.004})
        assert rt._kernels is not None and rt._kernels.budget_s == pytest.approx(1.0 - (2 + 5) * 0.004 * 2)
    monkeypatch.setattr(kernel_check, "time_kernels", lambda calls, device, kernels, **_: {None: 0.02})
    with Runtime(devices="cpu", compile="off") as rt:
        flash = loop(rt, EAGER_END + PHASE + 3, {"fp32": 0.004, "bf16-mixed": 0.004})
        attention = rt.explain().attention
    assert all(flash) and attention.value == "default"
    assert "torch's pick kept: timing the kernels of the model's attention calls (1) would take longer than" in (
        attention.reason
    )


def test_a_call_under_autocast_is_recorded_in_the_dtype_it_runs_in():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        calls = attention_calls(small_gpt(), torch.randint(0, 32, (2, 16)))
    assert calls[0].dtype == torch.bfloat16
    q = torch.randn(1, 2, 8, 4)  # fp32 inputs straight into the function: autocast casts them too
    with attention_module.recording() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(8, 8))
    assert seen[0].dtype == torch.bfloat16 and seen[0].mask == ((8, 8), torch.bfloat16)


def test_torchs_pick_kept_in_the_bf16_phase_says_fp32_stayed_when_it_did(kernel_times):
    kernel_times["math"] = 0.019  # within KEEP of torch's pick
    with Runtime(devices="cpu", compile="off") as rt:
        loop(rt, EAGER_END + PHASE + 3, {"fp32": 0.004, "bf16-mixed": 0.008})
        attention = rt.explain().attention
    assert attention.value == "default" and attention.reason.endswith("; fp32 stays")


def test_every_layers_call_counts_toward_the_weights_math_keeps(monkeypatch):
    torch.manual_seed(0)
    two = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16))
    calls = attention_calls(two, torch.randint(0, 32, (2, 16)))
    assert len(calls) == 2 and calls[0] == calls[1]  # alike, and each a layer's weights
    one_layer = 2 * (2 * 2 * 16 * 16 * 4)  # weights and their gradient, fp32
    monkeypatch.setattr(attention_module, "_free_bytes", lambda device: int(1.5 * one_layer / 0.25))
    assert attention_module.math_fits(calls[:1], HERE) and not attention_module.math_fits(calls, HERE)


def test_autocast_casts_every_floating_input_but_float64_and_the_call_is_recorded_so():
    q = torch.randn(1, 2, 8, 4, dtype=torch.float16)
    with attention_module.recording() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        torch.nn.functional.scaled_dot_product_attention(q.double(), q.double(), q.double())
    assert [call.dtype for call in seen] == [torch.bfloat16, torch.float64]


def test_the_calls_nn_multihead_attention_makes_in_every_transformer_layer_are_seen_and_fs_name_comes_back():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train()
    named = torch.nn.functional.scaled_dot_product_attention
    calls = attention_calls(encoder, torch.randn(4, 8, 16))
    assert [call.shapes[0] for call in calls] == [(4, 2, 8, 8)] * 2  # one call a layer, per head
    assert torch.nn.functional.scaled_dot_product_attention is named
    assert kernels_taking(calls, HERE) == ["flash", "math"]
    weighing = nn.MultiheadAttention(16, 2, batch_first=True)  # returning the weights: its own arithmetic, no kernel
    x = torch.randn(4, 8, 16)
    assert attention_calls(_Called(weighing, need_weights=True), x) == []
    assert len(attention_calls(_Called(weighing, need_weights=False), x)) == 1
    with pytest.raises(AssertionError), attention_module.recording():
        weighing(x, torch.randn(4, 8, 3), x, need_weights=False)  # a key of the wrong width fails inside
    assert torch.nn.functional.scaled_dot_product_attention is named


class _Called(nn.Module):
    def __init__(self, attention: nn.MultiheadAttention, *, need_weights: bool) -> None:
        super().__init__()
        self.attention, self.need_weights = attention, need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=self.need_weights)[0]


class _Counting(attention_mode.AttentionMode):
    """Counts the calls it sees; ``stop`` runs them itself, as the memory trace's mode does, without the function."""

    def __init__(self, *, stop: bool = False) -> None:
        super().__init__()
        self.seen, self.stop = 0, stop

    def attend(self, sdpa, *args, **kwargs):
        self.seen += 1
        if self.stop:
            return torch.zeros_like(args[0])
        return sdpa(*args, **kwargs)


class _MhaThenDirect(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.attention(x, x, x, need_weights=False)[0]
        q = y.view(4, 8, 2, 8).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


@pytest.mark.parametrize("stop", [False, True])
def test_modes_stacked_each_see_both_kinds_of_call_in_their_order(stop):
    model, x = _MhaThenDirect(), torch.randn(4, 8, 16)
    lower = _Counting(stop=stop)
    with torch.no_grad(), lower, attention_module.recording() as calls:  # the recorder on top sees each call first
        model(x)
    assert len(calls) == 2 and lower.seen == 2
    assert torch.nn.functional.scaled_dot_product_attention is attention_mode.TORCH_SDPA


def test_another_threads_attention_runs_on_torchs_function_while_a_window_is_open():
    started, other_done = threading.Event(), threading.Event()
    seen: list[str] = []

    class Waiting(attention_mode.AttentionMode):
        def attend(self, sdpa, *args, **kwargs):
            seen.append(threading.current_thread().name)
            started.set()
            other_done.wait(timeout=30)
            return sdpa(*args, **kwargs)

    mha, x = nn.MultiheadAttention(16, 2, batch_first=True), torch.randn(4, 8, 16)

    def run() -> None:
        with torch.no_grad(), Waiting():
            mha(x, x, x, need_weights=False)

    worker = threading.Thread(target=run, name="windowed")
    worker.start()
    assert started.wait(timeout=30)
    assert torch.nn.functional.scaled_dot_product_attention is not attention_mode.TORCH_SDPA  # the window is open
    q = torch.randn(2, 2, 8, 8)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q)  # this thread's: no mode of its own
    other_done.set()
    worker.join(timeout=30)
    assert seen == ["windowed"] and out.shape == q.shape
    assert torch.nn.functional.scaled_dot_product_attention is attention_mode.TORCH_SDPA


def test_windows_closed_out_of_order_on_two_threads_give_fs_name_back():
    first_open, second_open, first_closed = threading.Event(), threading.Event(), threading.Event()
    held: list[bool] = []

    def first() -> None:
        with attention_mode._window(lambda sdpa, *a, **k: sdpa(*a, **k)):
            first_open.set()
            second_open.wait(timeout=30)
        first_closed.set()  # closed before the window opened after it

    def second() -> None:
        first_open.wait(timeout=30)
        with attention_mode._window(lambda sdpa, *a, **k: sdpa(*a, **k)):
            second_open.set()
            first_closed.wait(timeout=30)
            held.append(torch.nn.functional.scaled_dot_product_attention is not attention_mode.TORCH_SDPA)  # open

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert held == [True] and torch.nn.functional.scaled_dot_product_attention is attention_mode.TORCH_SDPA


def test_a_wrapper_put_on_fs_name_and_taken_off_across_a_window_leaves_attention_working(monkeypatch):
    """A window opens; something wraps F's name and the window closes (the wrapper keeps the name); the wrapper is
    taken off, putting back the window's function with no window open. Calls still reach torch's function, once."""
    functional = torch.nn.functional
    mha, x = nn.MultiheadAttention(16, 2, batch_first=True), torch.randn(4, 8, 16)
    with attention_mode._window(lambda sdpa, *a, **k: sdpa(*a, **k)):
        inside = functional.scaled_dot_product_attention
        monkeypatch.setattr(functional, "scaled_dot_product_attention", lambda *a, **k: inside(*a, **k))
    monkeypatch.undo()  # the name leads to the window's function again, with no window open
    q = torch.randn(2, 2, 8, 8)
    assert functional.scaled_dot_product_attention(q, q, q).shape == q.shape
    with torch.no_grad(), attention_module.recording() as calls:
        mha(x, x, x, need_weights=False)  # a window opens and closes again: no call loops back to itself
    assert len(calls) == 1
    assert functional.scaled_dot_product_attention is attention_mode.TORCH_SDPA


def test_a_mode_that_calls_attention_by_name_again_is_not_handed_its_own_call():
    class ByName(attention_mode.AttentionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen = 0

        def attend(self, sdpa, *args, **kwargs):
            self.seen += 1
            return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)  # not the sdpa given

    mode, mha, x = ByName(), nn.MultiheadAttention(16, 2, batch_first=True), torch.randn(4, 8, 16)
    with torch.no_grad(), mode:
        mha(x, x, x, need_weights=False)
    assert mode.seen == 1


# -- a user's loop that starts in a reduced precision times the kernels after its first training forward ------------


def test_a_user_loop_asking_bf16_times_the_kernels_on_its_first_forwards_calls_and_prefers_the_winner(kernel_times):
    before = flags()
    with Runtime(devices="cpu", precision="bf16-mixed", compile="off") as rt:
        flash = loop(rt, 3, {"bf16-mixed": 0.004})
        attention = rt.explain().attention
    assert flash == [False] * 3  # math from the step after the first forward on
    assert (rt.explain().precision.value, attention.value) == ("bf16-mixed", "math")
    assert attention.reason.startswith(
        "measured on this run: math ran 2.00x torch's pick (the model's attention calls (1)"
    )
    assert flags() == before


def test_no_kernel_is_timed_where_the_run_decided_before_or_must_repeat_itself(kernel_times, monkeypatch):
    timed = []
    monkeypatch.setattr(kernel_check, "time_kernels", lambda *a, **k: timed.append(a) or {None: 0.02})
    for options, measured in [
        ({"attention": "flash"}, None),  # a kernel named
        ({"deterministic": True}, None),
        ({}, {}),  # a Runtime given a trial's word (the Trainer's, a bench row's): the trial decided
        ({"precision": "fp32"}, None),  # no reduced precision
    ]:
        rt = Runtime(devices="cpu", compile="off", measured=measured, **{"precision": "bf16-mixed", **options})
        with rt:
            flash = loop(rt, 2, {"bf16-mixed": 0.004, "fp32": 0.004})
        assert all(flash) and timed == [] and rt.explain().attention.value != "math", options


def test_only_a_training_forward_in_rt_autocast_is_timed_and_the_model_carries_no_hook_of_the_check(
    kernel_times, monkeypatch
):
    timed = []
    faked = kernel_check.time_kernels  # the fixture's: math twice as fast as torch's pick
    monkeypatch.setattr(kernel_check, "time_kernels", lambda calls, *a, **k: timed.append(calls) or faked(calls, *a))
    with Runtime(devices="cpu", precision="bf16-mixed", compile="off") as rt:
        model, optimizer = rt.setup(small_gpt(), lambda params: torch.optim.SGD(params, lr=0.01))
        assert not model._forward_hooks and not model._forward_pre_hooks  # a copy or a pickle of it carries none
        tokens = torch.randint(0, 32, (4, 17))
        model(tokens[:, :-1])  # a forward outside rt.autocast(): fp32, not the run's precision
        with torch.no_grad(), rt.autocast():  # an evaluation first: no training forward
            model(tokens[:, :-1])
        assert timed == [] and rt.explain().attention.value == "default"
        with rt.autocast():
            loss = model(tokens[:, :-1]).float().square().mean()
        rt.backward(loss)
        rt.step(optimizer)
        with rt.autocast():  # checked once
            model(tokens[:, :-1])
    assert len(timed) == 1 and [call.dtype for call in timed[0]] == [torch.bfloat16]
    assert rt.explain().attention.value == "math"


def test_a_first_forward_that_fails_leaves_no_recorder_on_torchs_stack_and_the_next_one_is_checked(kernel_times):
    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt, self.fail = small_gpt(), True

        def forward(self, tokens):
            out = self.gpt(tokens)
            if self.fail:
                self.fail = False
                raise RuntimeError("made up by the test")
            return out

    with Runtime(devices="cpu", precision="bf16-mixed", compile="off") as rt:
        model, optimizer = rt.setup(Failing(), lambda params: torch.optim.SGD(params, lr=0.01))
        tokens = torch.randint(0, 32, (4, 17))
        with pytest.raises(RuntimeError, match="made up"), rt.autocast():
            model(tokens[:, :-1])
        assert not torch.overrides._get_current_function_mode_stack()
        with rt.autocast():
            loss = model(tokens[:, :-1]).float().square().mean()
        rt.backward(loss)
        rt.step(optimizer)
        assert rt.explain().attention.value == "math" and flags()[0] is False


def test_a_runtime_closed_or_paused_times_nothing_and_leaves_torchs_flags(kernel_times):
    before = flags()
    rt = Runtime(devices="cpu", precision="bf16-mixed", compile="off")
    with rt:
        model, _ = rt.setup(small_gpt(), lambda params: torch.optim.SGD(params, lr=0.01))
    tokens = torch.randint(0, 32, (4, 17))
    with rt.autocast():  # a step after close: nothing is timed, nothing preferred
        model(tokens[:, :-1])
    assert flags() == before and rt.explain().attention.value == "default"
    paused = Runtime(devices="cpu", precision="bf16-mixed", compile="off")
    model, _ = paused.setup(small_gpt(), lambda params: torch.optim.SGD(params, lr=0.01))
    paused.pause()
    with paused.autocast():  # outside a turn: the run is not on
        model(tokens[:, :-1])
    assert flags() == before
    with paused.turn(), paused.autocast():  # its turn: timed, and the kernel runs from the next forward
        model(tokens[:, :-1])
    assert flags() == before and paused.explain().attention.value == "math"
    with paused.turn():
        assert flags()[0] is False
    paused.close()
    assert flags() == before


def test_a_loop_whose_calls_only_torchs_pick_takes_is_told_so_without_timing(kernel_times, monkeypatch):
    monkeypatch.setattr(kernel_check, "time_kernels", lambda *a, **k: pytest.fail("nothing to time"))
    with Runtime(devices="cpu", precision="bf16-mixed", compile="off") as rt:
        model, _ = rt.setup(small_gpt(dropout=0.1), lambda params: torch.optim.SGD(params, lr=0.01))
        with rt.autocast():  # on a CPU math alone takes attention with dropout in training, and torch picks it
            model(torch.randint(0, 32, (4, 16)))
        attention = rt.explain().attention
    assert attention.value == "default"
    assert attention.reason.endswith("no other kernel takes the model's attention calls (1) under bf16-mixed")


def test_the_outermost_training_autocast_records_and_a_forward_without_attention_leaves_the_check_pending(
    kernel_times,
):
    with Runtime(devices="cpu", precision="bf16-mixed", compile="off") as rt:
        model, optimizer = rt.setup(small_gpt(), lambda params: torch.optim.SGD(params, lr=0.01))
        tokens = torch.randint(0, 32, (4, 17))
        with rt.autocast():  # a training autocast around something else first: no attention call
            torch.ones(2, requires_grad=True).sum()
        model.eval()
        with rt.autocast():  # an evaluation forward with autograd on: not a training forward
            model(tokens[:, :-1])
        model.train()
        assert rt.explain().attention.value == "default" and rt._kernels.pending == "bf16-mixed"
        with rt.autocast():
            logits = model(tokens[:, :-1])
            with rt.autocast():  # a loop that enters it again around its loss: the outer one records
                loss = logits.float().square().mean()
        rt.backward(loss)
        rt.step(optimizer)
        assert rt.explain().attention.value == "math" and flags()[0] is False


def test_a_loop_that_sets_its_own_kernels_is_not_timed_and_gets_its_choice(kernel_times):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before = flags()
    with Runtime(devices="cpu", precision="bf16-mixed", compile="off") as rt:
        model, _ = rt.setup(small_gpt(), lambda params: torch.optim.SGD(params, lr=0.01))
        with sdpa_kernel([SDPBackend.MATH]), rt.autocast():
            model(torch.randint(0, 32, (4, 16)))
            assert flags()[:4] == (False, False, True, False)  # the loop's own choice, untouched
        attention = rt.explain().attention
    assert attention.value == "default" and attention.reason.endswith("the loop sets its own attention kernels")
    assert flags() == before


def test_a_model_the_user_compiled_is_not_recorded_so_dynamo_compiles_it_once(kernel_times):
    from redline.runtime.compile import compiled_by_user as compiled

    plain, part = small_gpt(), small_gpt()
    part.blocks[0].compile(backend="eager")
    assert not compiled(plain) and compiled(part) and compiled(torch.compile(small_gpt(), backend="eager"))
    with Runtime(devices="cpu", precision="bf16-mixed", compile="off") as rt:
        rt.setup(part, lambda params: torch.optim.SGD(params, lr=0.01))
        assert rt._kernels is None


@pytest.mark.parametrize(("fp32_ms", "kept"), [(6.0, "bf16-mixed"), (2.0, "fp32")])
def test_a_run_that_starts_in_bf16_keeps_its_kernel_out_of_the_fp32_phase_and_drops_it_if_fp32_stays(
    kernel_times, fp32_ms, kept
):
    """A GPU's rule starts in bf16 and times fp32 against it: the kernels are timed after the first bf16 forward, the
    kernel chosen sits out the fp32 phase (math would take fp32 calls a fused kernel cannot), and goes if fp32
    stays. Driven on this CPU with the switch a GPU run builds, on a fake clock."""
    from redline.plan import Choice
    from redline.runtime.compile_check import CompileCheck
    from redline.runtime.kernel_check import KernelCheck
    from redline.runtime.precision_check import PrecisionSwitch, autocast_for

    before, model, now, current = flags(), small_gpt(), [0.0], ["bf16-mixed"]
    kernels = KernelCheck(HERE, Choice("default", "auto: torch's pick"), pending="bf16-mixed", module=model)
    switch = PrecisionSwitch(Choice("bf16-mixed", "auto: the rule"), "fp32", lambda n: current.__setitem__(0, n), "cpu")
    switch.kernels = kernels
    switch.watch(model)
    check = CompileCheck(Choice(False, "auto: no compile"), 0, StepTimer(Stopwatch(clock=lambda: now[0])))
    check.add_precision(switch, lambda: None)
    tokens, seen = torch.randint(0, 32, (4, 16)), []
    with kernels.held():
        for _ in range(EAGER_END + PHASE + 2):
            with kernels.around(autocast_for(current[0], "cpu")):
                model(tokens)
            seen.append((current[0], flags()[0]))  # the precision of the step, and whether flash is on after it
            now[0] += (fp32_ms if current[0] == "fp32" else 4.0) / 1e3
            check.after_step()
    assert seen[:EAGER_END] == [("bf16-mixed", False)] * EAGER_END  # math from the step after the first forward
    assert seen[EAGER_END + 1 : EAGER_END + 3] == [("fp32", True)] * 2  # torch's own flags in the fp32 phase
    after = seen[-1]
    assert check.precision_choice.value == kept and after == (kept, kept == "fp32")
    attention = kernels.chosen
    assert (attention.value, attention.reason.endswith("but fp32 stays")) == (
        ("math", False) if kept == "bf16-mixed" else ("default", True)
    )
    assert flags() == before
