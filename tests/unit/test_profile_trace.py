"""Reading a torch.profiler trace into a step's phases, and the advice drawn from them (traces fed as data)."""

import dataclasses

import pytest

from redline.bench.advice import advise
from redline.bench.trace import Breakdown, Phase, _covered, read_breakdown
from redline.errors import TrainingError
from redline.plan import Choice, Plan


def span(name, ts, dur, tid=1, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def step(n, ts, data=10, forward=30, backward=40, optimizer=10):
    """A 100 us step: its phases back to back from ``ts``, the rest (10 us) outside them."""
    out, at = [span(f"ProfilerStep#{n}", ts, 100)], ts
    for name, dur in (("data", data), ("forward", forward), ("backward", backward), ("optimizer", optimizer)):
        out.append(span(f"redline.{name}", at, dur))
        at += dur
    return out


def launch(corr, ts, tid=1):
    return {**span("cudaLaunchKernel", ts, 2, tid=tid, cat="cuda_runtime"), "args": {"correlation": corr}}


def kernel(corr, ts, dur):
    return {**span(f"kernel {corr}", ts, dur, tid=7, cat="kernel"), "args": {"correlation": corr}}


def test_each_phase_is_its_host_time_per_step_and_the_rest_is_other():
    found = read_breakdown([*step(1, 0), *step(2, 100, data=20, forward=20), span("aten::mm", 15, 5, cat="cpu_op")])
    assert found.steps == 2 and found.step_ms == pytest.approx(0.1)
    by_name = {p.name: p for p in found.phases}
    assert [p.name for p in found.phases] == ["data", "forward", "backward", "optimizer", "other"]
    assert by_name["data"].host_ms == pytest.approx(0.015) and by_name["data"].share == pytest.approx(0.15)
    assert by_name["forward"].host_ms == pytest.approx(0.025)
    assert by_name["other"].host_ms == pytest.approx(0.010)
    assert sum(p.share for p in found.phases) == pytest.approx(1.0)
    assert found.device_busy is None and by_name["forward"].device_ms is None  # no GPU in the trace


def test_kernels_count_for_the_phase_that_launched_them_from_any_thread():
    events = [
        *step(1, 1000),
        *step(2, 1100),
        launch(1, 1015), kernel(1, 1020, 30),  # forward of step 1 (data is 1000-1010, forward 1010-1040)
        launch(2, 1050, tid=2), kernel(2, 1050, 40),  # backward, launched from autograd's thread
        launch(3, 1085), kernel(3, 1085, 10),  # optimizer
        launch(4, 1115), kernel(4, 1115, 10), kernel(5, 1118, 4),  # a copy on another stream overlaps
        launch(5, 1116),
        launch(6, 990), kernel(6, 1000, 50),  # launched before the recorded steps: left out
        kernel(7, 1195, 5),  # no launch recorded: other
    ]  # fmt: skip
    found = read_breakdown(events)
    device = {p.name: p.device_ms for p in found.phases}
    assert device == pytest.approx(
        {"data": 0.0, "forward": 0.022, "backward": 0.020, "optimizer": 0.005, "other": 0.0025}
    )  # forward: 30 us in step 1, 10 + 4 in step 2 (two streams); per step, in ms
    # busy: 1020-1050, 1050-1090, 1085-1095 -> 1020-1095 (75), 1115-1125 (10), 1195-1200 (5) of 200 us
    assert found.device_busy == pytest.approx(90 / 200)


def test_a_trace_without_a_step_says_so():
    with pytest.raises(TrainingError, match="the profiler recorded no step"):
        read_breakdown([span("redline.forward", 0, 10)])


def test_overlapping_intervals_count_once():
    assert _covered([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert _covered([]) == 0


def breakdown(data=0.05, forward=0.4, backward=0.45, optimizer=0.05, busy=None):
    shares = {"data": data, "forward": forward, "backward": backward, "optimizer": optimizer}
    phases = tuple(Phase(name, share * 10, share) for name, share in shares.items())
    return Breakdown(steps=5, step_ms=10.0, phases=(*phases, Phase("other", 0.0, 0.0)), device_busy=busy)


PLAN = Plan(
    device=Choice("cuda", "auto"),
    precision=Choice("bf16-mixed", "auto"),
    tf32=Choice(True, "auto"),
    grad_accum=Choice(1, "default"),
    clip_grad_norm=Choice(None, "default"),
    loader=Choice("workers=0 pin_memory=off", "kept"),
)


def test_advice_names_the_phase_that_costs_and_the_flag_to_try():
    said = advise(breakdown(data=0.3, forward=0.3, backward=0.3, optimizer=0.1), PLAN, env={}, anomaly=False)
    assert len(said) == 1
    assert said[0].startswith("loading: 30% of each step waits for the next batch (loader workers=0 pin_memory=off)")
    # the command that takes the flag: `redline profile` has no --loader-workers
    assert "try `redline train --loader-workers N`" in said[0] and "`redline tune` measures loader workers" in said[0]
    idle = advise(breakdown(busy=0.35), PLAN, env={}, anomaly=False)
    assert len(idle) == 1 and idle[0].startswith("the GPU is idle 65% of each step") and "reduce-overhead" in idle[0]
    assert advise(breakdown(busy=0.9), PLAN, env={}, anomaly=False)[0].startswith("no phase stands out")
    heavy = advise(breakdown(optimizer=0.4, forward=0.25, backward=0.3), PLAN, env={}, anomaly=False)
    assert heavy[0].startswith("the optimizer step takes 40% of each step")


def test_loading_from_tensors_in_memory_is_not_sent_to_workers_the_tune_would_not_measure():
    import dataclasses

    from redline.plan.loader import LoaderSettings

    gathered = LoaderSettings(num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=None,
                              rebuild=True, gather=True)  # fmt: skip
    plan = dataclasses.replace(PLAN, loader=Choice(gathered, "auto"))
    (said,) = advise(breakdown(data=0.3, forward=0.3, backward=0.3, optimizer=0.1), plan, env={}, anomaly=False)
    assert said.startswith("loading: 30% of each step waits for the next batch (loader workers=0 pin_memory=off "
                           "gather=on): each is gathered whole from the tensors in memory")  # fmt: skip
    assert "--loader-workers" not in said and "redline tune" not in said and "--batch-size 64,128" in said


def test_the_advice_for_an_idle_gpu_names_commands_that_measure_what_it_suggests():
    (said,) = advise(breakdown(busy=0.35), PLAN, env={}, anomaly=False, batch_size=32)
    assert "a larger --batch-size (`redline bench --batch-size 32,64` measures it)" in said
    # bench has no --compile-mode: its compiled rows run the default mode, never CUDA graphs
    assert "`redline bench --compile on`" not in said
    assert "`redline profile --cuda-graphs on` shows their step" in said
    assert said.endswith("`redline tune` measures both")
    compiled = dataclasses.replace(PLAN, compile=Choice(True, "requested; mode=reduce-overhead"))
    (graphs,) = advise(breakdown(busy=0.35), compiled, env={}, anomaly=False, batch_size=32, graphs=True)
    assert graphs.startswith("the GPU is idle 65% of each step though the step runs as CUDA graphs: the host")
    assert graphs.endswith("try a larger --batch-size (`redline bench --batch-size 32,64` measures it)")
    assert "reduce-overhead" not in graphs  # what already runs is not proposed again


def test_a_heavy_optimizer_that_runs_fused_already_is_not_told_to_fuse():
    heavy = breakdown(optimizer=0.4, forward=0.25, backward=0.3)
    fused = dataclasses.replace(PLAN, optimizer=Choice("fused", "AdamW rebuilt fused: one kernel updates every"))
    (said,) = advise(heavy, fused, env={}, anomaly=False, batch_size=16)
    assert said == (
        "the optimizer step takes 40% of each step though it runs fused: its cost does not grow with the batch, "
        "so a larger --batch-size spreads it (`redline bench --batch-size 16,32` measures it)"
    )
    (given,) = advise(heavy, dataclasses.replace(PLAN, optimizer=Choice("as given", "AdamW")), env={}, anomaly=False)
    assert "unless the optimizer is foreach or fused" in given
    slower = Choice("as given", "AdamW: kept as given, as fused stepped 0.80x as fast (0.50 ms against 0.40 ms a step")
    (timed,) = advise(heavy, dataclasses.replace(PLAN, optimizer=slower), env={}, anomaly=False)
    assert "its fused kernel stepped 0.80x as fast here, too little to take" in timed
    assert "foreach=True in the optimizer's factory" in timed
    assert "unless the optimizer is foreach or fused" not in timed  # fused, measured slower, is not proposed again


def test_when_nothing_stands_out_the_advice_names_only_what_the_plan_does_not_run_yet():
    plain = dataclasses.replace(PLAN, precision=Choice("fp32", "auto"), compile=Choice(False, "auto"))
    said = advise(breakdown(), plain, env={}, anomaly=False)[0]
    assert said.endswith("reduced precision or compile may shorten it, and `redline tune` measures both")
    compiled = dataclasses.replace(plain, compile=Choice(True, "auto"))
    assert advise(breakdown(), compiled, env={}, anomaly=False)[0].endswith(
        "reduced precision may shorten it, and `redline tune` measures it"
    )
    both = dataclasses.replace(PLAN, compile=Choice(True, "auto"))  # bf16-mixed and compiled already
    assert "a larger --batch-size" in advise(breakdown(), both, env={}, anomaly=False)[0]


def test_what_the_plan_timed_here_and_ran_faster_without_is_not_proposed_again():
    # After a tune (or auto's trial) kept fp32 and eager as the faster, the advice still proposed both.
    tuned = dataclasses.replace(
        PLAN,
        precision=Choice("fp32", "tuned 2026-12-06 11:17 UTC for 16 steps: fp32 kept (fp32 0.33 ms/step; bf16 0.99)"),
        compile=Choice(False, "tuned 2026-12-06 11:17 UTC for 16 steps: compile off kept (eager 1.94 ms/step; ...)"),
    )
    (said,) = advise(breakdown(), tuned, env={}, anomaly=False, batch_size=32)
    assert said.endswith(
        "; reduced precision and compile ran slower here, as the Plan measured: a larger --batch-size "
        "(`redline bench --batch-size 32,64` measures it) or a faster device is what is left"
    ), said
    trial = dataclasses.replace(tuned, precision=Choice("fp32", "measured: fp32 kept, bf16-mixed 0.52x"),
                                compile=Choice(False, "auto: eager on a CPU"))  # fmt: skip
    (left,) = advise(breakdown(), trial, env={}, anomaly=False)
    assert left.endswith(
        "; compile may shorten it, and `redline tune` measures it (reduced precision ran slower here, as the Plan "
        "measured)"
    ), left
    # a tune that did not try compiling (the planned run too short for any compile) measured nothing of it
    short = dataclasses.replace(tuned, compile=Choice(False, "tuned 2026-12-07 for 14 steps: compile off kept, not "
                                                      "tried: the planned 14 steps take 0.71 s eagerly"))  # fmt: skip
    (untried,) = advise(breakdown(), short, env={}, anomaly=False)
    assert "compile ran slower" not in untried and "compile may shorten it" in untried, untried


def test_a_device_without_a_fast_reduced_precision_is_not_told_to_try_one():
    """On an AVX2 CPU (no fast bf16) the advice proposed reduced precision, which the Plan above it and the tune both
    said the device lacks; a slow one given is told fp32 instead."""
    plain = dataclasses.replace(PLAN, precision=Choice("fp32", "auto"), compile=Choice(False, "auto"))
    (said,) = advise(breakdown(), plain, env={}, anomaly=False, fast=())
    assert said.endswith("; compile may shorten it, and `redline tune` measures it") and "precision" not in said
    compiled = dataclasses.replace(plain, compile=Choice(True, "auto"))
    (done,) = advise(breakdown(), compiled, env={}, anomaly=False, fast=())
    assert "the Plan already runs compiled (this device has no reduced precision faster than fp32)" in done
    slow = dataclasses.replace(plain, precision=Choice("bf16-mixed", "requested"))
    (told,) = advise(breakdown(), slow, env={}, anomaly=False, fast=())
    assert told.startswith("bf16-mixed has no fast arithmetic on this device, where fp32 is likely faster")
    assert told.endswith("`redline bench --precision fp32,bf16-mixed` measures it")
    fp16 = dataclasses.replace(plain, precision=Choice("fp16-mixed", "requested"))  # on a CPU with fast bf16
    (other,) = advise(breakdown(), fp16, env={}, anomaly=False, fast=("bf16-mixed",))
    assert other.endswith("`redline bench --precision fp32,bf16-mixed,fp16-mixed` measures it")
    (kept,) = advise(breakdown(), dataclasses.replace(fp16, precision=Choice("bf16-true", "requested")), env={},
                     anomaly=False, fast=("bf16-mixed",))  # fmt: skip
    assert kept.startswith("no phase stands out"), "bf16 weights have the device's fast bf16 arithmetic"


def test_an_optimizer_the_user_built_fused_or_foreach_is_not_told_to_be():
    heavy = breakdown(optimizer=0.4, forward=0.25, backward=0.3)
    given = dataclasses.replace(PLAN, optimizer=Choice("as given", "AdamW: implementation set by the user"))
    for way in ("fused", "foreach"):
        (said,) = advise(heavy, given, env={}, anomaly=False, batch_size=8, optimizer=way)
        assert said.startswith(f"the optimizer step takes 40% of each step though it runs {way}: its cost"), said


def test_debugging_switches_left_on_are_named_first():
    said = advise(breakdown(busy=0.9), PLAN, env={"CUDA_LAUNCH_BLOCKING": "1"}, anomaly=True, gpu=True)
    assert said[0].startswith("autograd anomaly detection is on")
    assert said[1].startswith("CUDA_LAUNCH_BLOCKING=1 makes every kernel launch wait")
    assert len(said) == 2  # nothing stands out beside them
    # on a CPU the variable does nothing: it is not named, and the advice of the step's own costs stays
    (cpu,) = advise(breakdown(), PLAN, env={"CUDA_LAUNCH_BLOCKING": "1"}, anomaly=False)
    assert cpu.startswith("no phase stands out")
    assert advise(breakdown(), PLAN, env={"CUDA_LAUNCH_BLOCKING": "0"}, anomaly=False)[0].startswith("no phase")


def test_a_gpu_run_whose_trace_holds_no_kernel_says_the_times_are_the_hosts():
    said = advise(breakdown(), PLAN, env={}, anomaly=False, gpu=True)
    assert said[0].startswith("the trace holds no GPU kernel: the profiler could not record the GPU (CUPTI")
    assert not advise(breakdown(busy=0.9), PLAN, env={}, anomaly=False, gpu=True)[0].startswith("the trace holds")


def test_the_operators_table_gives_each_operator_one_line_in_80_columns():
    from rich.console import Console

    from redline.render.console import print_uncut
    from redline.render.profile import ops_table

    graph = "## Call CompiledFxGraph f7j22vsuvjdghffrnbbwzl7mw2otq2n45g24citytisvabcdefgh ##"  # as torch names it
    ops = [{"name": graph, "self_ms": 0.021, "calls": 2 / 3, "share": 0.03}]
    ops.append({"name": "aten::addmm", "self_ms": 0.029, "calls": 2.0, "share": 0.043})
    console = Console(width=80, record=True)
    print_uncut(console, ops_table({"breakdown": {"device_busy": None}, "ops_on": "host", "ops": ops}))
    rows = [line for line in console.export_text().splitlines() if "0.02" in line]
    assert len(rows) == 2 and all(len(row) <= 80 for row in rows)
    assert rows[0].split()[:4] == ["##", "Call", "CompiledFxGraph", "f7j22vsuvjdghffrnbb…"]
    assert rows[0].split()[-3:] == ["0.021", "0.667", "3.0%"]  # calls per step to three figures, not 0.666667
    assert rows[1].split() == ["aten::addmm", "0.029", "2", "4.3%"]


def test_each_share_in_the_profile_tables_says_what_it_is_a_share_of():
    from rich.console import Console

    from redline.render.profile import ops_table, phases_table

    phases = [{"name": "forward", "host_ms": 1.0, "share": 0.5, "device_ms": None}]
    found = {"breakdown": {"device_busy": None, "phases": phases}, "ops_on": "host", "ops": []}
    console = Console(width=120, record=True)
    console.print(phases_table(found), ops_table(found))
    text = console.export_text()
    headers = [line.split() for line in text.splitlines() if "ms/step" in line]
    assert headers == [
        ["phase", "host", "ms/step", "of", "step"],
        ["operator", "ms/step", "calls/step", "of", "all"],
    ]


def test_a_step_whose_flops_cannot_be_counted_says_so_rather_than_dropping_the_line():
    from redline.render.profile import summary_lines

    found = {"breakdown": {"device_busy": None}, "peak_memory_bytes": None, "advice": [], "trace": None}
    assert summary_lines({**found, "tflops": 0.125})[0] == "achieved: 0.125 TFLOP/s (the profiler's overhead included)"
    assert summary_lines({**found, "tflops": None, "flops_per_step": None})[0].startswith(
        "achieved: n/a (the FLOPs are counted on meta tensors"
    )
    # counted, and none: an elementwise step is not blamed on a .item() that stops the count
    assert summary_lines({**found, "tflops": 0.0, "flops_per_step": 0})[0] == (
        "achieved: n/a (no matmul or convolution FLOPs were counted: the step's work is elementwise)"
    )
