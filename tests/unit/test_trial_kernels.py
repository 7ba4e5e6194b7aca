"""The precision trial of a run too short to time every attention kernel in whole steps: each precision is timed on
the kernel its attention calls, timed alone, run fastest on (runtime/measure.py, ``picked_forms``)."""

import pytest
import torch
from tests.unit.test_attention import gpt_task

from redline.parallel.env import DistEnv
from redline.runtime import kernel_check, measure
from redline.runtime.attention import AttentionCall, model_attention
from redline.runtime.kernel_check import KEEP, preferred
from redline.runtime.measure import measure_auto, repaid_rounds
from redline.runtime.options import RuntimeOptions
from redline.runtime.trial import Measured, trial_steps
from redline.runtime.workload import KERNELS_TRIAL_S, workload

SHORT = 300  # steps: a trial of fp32 and bf16-mixed fits a tenth of it, one with bf16-mixed on math too does not
STEPS_MS = {"fp32": 10.0, "bf16-mixed": 11.0, "bf16-mixed with math attention": 7.0}


@pytest.fixture
def trial(tmp_path, monkeypatch):
    """Plan as on an AMX CPU, with a fake trial (bf16 1.1x slower than fp32 on torch's pick, 1.43x faster on math)
    and a fake timing of the attention calls (``calls["times"]``: seconds per kernel, None: torch's pick)."""
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("REDLINE_CPU", "amx")
    seen: dict = {"trials": [], "rounds": [], "timed": [], "times": {None: 0.02, "math": 0.01}}

    def fake_trial(model, optimizer, loss_fn, batch, device, candidates, *, rounds, **_):
        seen["trials"].append(list(candidates))
        seen["rounds"].append(rounds)
        return [Measured(name, (STEPS_MS[name] / 1e3,) * 12, (2.0, 1.8)) for name in ("fp32", *candidates)]

    def fake_timing(calls, device, kernels, *, budget_s=None, **_):
        seen["timed"].append((list(calls), list(kernels)))
        seen["budget"] = budget_s
        if isinstance(seen["times"], Exception):
            raise seen["times"]
        return {k: seen["times"][k] for k in kernels if k in seen["times"]}  # one left out: its passes overran

    monkeypatch.setattr(measure, "run_trial", fake_trial)
    monkeypatch.setattr(kernel_check, "time_kernels", fake_timing)
    return seen


def auto(steps: int = SHORT) -> dict:
    return measure_auto(gpt_task(), RuntimeOptions(devices="cpu"), 4, steps, DistEnv(), trial="auto")


def test_the_budget_of_the_case_fits_the_precision_alone_and_not_a_kernel_more():
    assert repaid_rounds(["bf16-mixed"], SHORT) >= 3 > repaid_rounds(["bf16-mixed", "bf16-mixed with m"], SHORT)


def test_a_run_too_short_for_every_kernel_times_bf16_on_the_kernel_its_calls_ran_fastest_and_takes_both(trial):
    found = auto()
    assert trial["trials"] == [["bf16-mixed with math attention"]]  # in place of bf16 on torch's pick, not beside it
    assert trial["rounds"] == [repaid_rounds(["bf16-mixed"], SHORT)]  # the steps of the precision alone
    assert trial_steps(["bf16-mixed with math attention"], trial["rounds"][0]) * 10 <= SHORT
    (calls, kernels), *_ = trial["timed"]
    assert kernels[0] is None and "math" in kernels  # torch's pick first, math set against it
    assert calls and all(call.dtype == torch.bfloat16 for call in calls)  # as bf16-mixed's autocast makes them
    assert (found["precision"].value, found["attention"].value) == ("bf16-mixed", "math")
    reason = found["precision"].reason
    assert reason.startswith("measured: bf16-mixed with math attention ran 1.43x fp32")
    assert "math attention picked for bf16-mixed" in reason and "ran 2.00x torch's pick" in reason
    again = auto()
    assert len(trial["trials"]) == 1 and len(trial["timed"]) == 1  # the second run reads the cache: nothing timed
    assert again["attention"].value == "math" and "cached from" in again["attention"].reason
    assert again["precision"].reason.split("; cached from")[0] == reason  # how math was picked, too
    fresh = measure_auto(gpt_task(), RuntimeOptions(devices="cpu"), 4, 5000, DistEnv(), trial="fresh")
    assert trial["trials"][-1] == ["bf16-mixed", "bf16-mixed with math attention"]  # every kernel in whole steps
    assert "picked for" not in fresh["precision"].reason and "picked for" not in auto()["precision"].reason


def test_torchs_pick_stays_where_no_kernel_runs_the_calls_keep_faster(trial):
    trial["times"] = {None: 0.02, "math": 0.02 / (KEEP - 0.05)}  # math not KEEP faster
    found = auto()
    assert trial["trials"] == [["bf16-mixed"]] and found["attention"].value == "default"  # the kernels were timed
    assert found["precision"].value == "fp32"  # bf16 on torch's pick lost to fp32, and no kernel was picked to help
    assert "torch's attention kernel kept for bf16-mixed: no other ran the model's attention calls (1)" in (
        found["precision"].reason
    )


def test_kernels_that_cannot_be_timed_leave_torchs_pick_and_the_precision_is_still_measured(trial):
    trial["times"] = RuntimeError("no kernel for you")
    found = auto()
    assert trial["trials"] == [["bf16-mixed"]] and found["attention"].value == "default"
    assert "bf16-mixed's attention kernels could not be timed (RuntimeError: no kernel for you): torch's pick" in (
        found["precision"].reason
    )


@pytest.mark.parametrize("times", [{None: 0.3}, {}])  # math, or every kernel, left untimed by the budget
def test_a_kernel_the_budget_left_untimed_is_never_said_to_have_lost(trial, times):
    trial["times"] = times
    found = auto()
    assert trial["trials"] == [["bf16-mixed"]] and trial["budget"] == KERNELS_TRIAL_S
    reason = found["attention"].reason
    assert "would take longer than 10 s on math (--attention KERNEL runs one)" in reason
    assert "no other ran" not in reason


def test_a_run_that_repays_every_kernel_in_whole_steps_times_no_call_alone(trial):
    found = auto(5000)
    assert trial["trials"] == [["bf16-mixed", "bf16-mixed with math attention"]] and trial["timed"] == []
    assert found["attention"].value == "math" and "picked for" not in found["attention"].reason


def test_the_kernel_preferred_is_the_fastest_only_where_it_beats_torchs_pick_by_keep():
    assert preferred({None: 0.02, "math": 0.01, "flash": 0.015}) == ("math", 2.0)
    assert preferred({None: 0.02, "math": 0.019})[0] is None
    assert preferred({None: 0.01, "math": 0.02}) == (None, 1.0)  # torch's pick is the fastest
    assert preferred({"math": 0.01}) == (None, 1.0) and preferred({}) == (None, 1.0)  # torch's pick was not timed


def test_a_call_under_a_dtype_casts_its_floating_inputs_but_float64_and_keeps_a_boolean_mask():
    call = AttentionCall(((2, 4, 8, 16),) * 3, torch.float32, ((8, 8), torch.float32), 0.0, False, False)
    cast = call.under(torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and cast.mask == ((8, 8), torch.bfloat16) and cast.shapes == call.shapes
    boolean = AttentionCall(((2, 4, 8, 16),) * 3, torch.float32, ((8, 8), torch.bool), 0.1, True, False)
    assert boolean.under(torch.float16).mask == ((8, 8), torch.bool)
    assert AttentionCall(((1, 1, 2, 2),) * 3, torch.float64, None, 0.0, False, False).under(torch.bfloat16).dtype == (
        torch.float64
    )


def test_the_kernels_are_picked_on_the_models_real_calls_with_torchs_own_timing(monkeypatch):
    """No fake: the calls of a small GPT, cast to bf16 and timed on this CPU's kernels, name one form of bf16-mixed."""
    monkeypatch.setenv("REDLINE_CPU", "amx")
    work = workload(gpt_task(), RuntimeOptions(devices="cpu"), 4, DistEnv())
    assert work is not None and work.candidates == ["bf16-mixed"]
    calls = model_attention(gpt_task(), "cpu")
    forms, told = work.picked_forms(calls)
    assert len(forms) == 1 and forms[0].startswith("bf16-mixed")
    assert ("picked for bf16-mixed" in told) is (forms[0] != "bf16-mixed") and "bf16-mixed" in told
