"""The tune's decisions and its cached Plan, on measurements given as data."""

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.bench.tune import _alternatives, decide, search_space, skipped_axes
from redline.errors import ConfigError
from redline.hardware.device import DeviceFacts
from redline.runtime import cache as cache_module
from redline.runtime.cache import write_cache
from redline.runtime.options import LAID_OUT_BY_AUTO, RuntimeOptions
from redline.runtime.tuned import (
    Candidate,
    Trial,
    TunedPlan,
    check_tuned_cache,
    load_tuned,
    store_tuned,
    tuned_for_model,
)
from redline.task import Task

AMX_CPU = DeviceFacts(type="cpu", name="Xeon", cpu_isa="amx", cpu_count=8)
AVX2_CPU = DeviceFacts(type="cpu", name="EPYC", cpu_isa="avx2", cpu_count=2)
H100 = DeviceFacts(type="cuda", name="NVIDIA H100 80GB HBM3", index=0, capability=(9, 0), cpu_count=16)
EAGER, COMPILED = Candidate(), Candidate(compile=True)


def test_a_compile_is_chosen_only_for_a_run_long_enough_to_repay_it():
    trials = [Trial(EAGER, 0.010), Trial(COMPILED, 0.006, compile_s=20.0)]  # 4 ms a step saved for 20 s
    short, why_short = decide("compile", trials, planned=1000)  # 10 s eager vs 26 s compiled
    assert short == EAGER and why_short.startswith("compile off kept")
    long, why_long = decide("compile", trials, planned=100_000)  # 1000 s vs 620 s
    assert long == COMPILED and why_long.startswith("compile on, 1.61x less time for 100000 steps")


def test_a_compile_the_on_disk_caches_served_is_said_to_be_one_and_kept_in_the_cache(tmp_path, monkeypatch):
    warm = Trial(COMPILED, 0.006, compile_s=0.3, compile_cached=True)
    _, why = decide("compile", [Trial(EAGER, 0.010), warm], planned=1000)
    assert "compiled (default): 6 ms/step + 0.3 s compile (cached on disk) = 6.3 s" in why
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    tuned = dataclasses.replace(tuned_plan(), trials=(Trial(EAGER, 0.010), warm))
    path = Path(store_tuned("fingerprint", AMX_CPU, tuned))
    assert load_tuned("fingerprint", AMX_CPU, 8) == tuned
    data = json.loads(path.read_text())
    del data["trials"][1]["compile_cached"]  # a tune made before the mark: its compiles are not said to be cached
    path.write_text(json.dumps(data))
    assert load_tuned("fingerprint", AMX_CPU, 8).trials[1].compile_cached is False


def test_a_slow_candidates_step_is_told_in_whole_milliseconds_not_in_e_notation():
    _, reason = decide("precision", [Trial(Candidate(), 2.6624), Trial(Candidate(precision="bf16-mixed"), 0.0421)], 10)
    assert "fp32, eager: 2,662 ms/step = 26.6 s" in reason and "42.1 ms/step" in reason and "e+" not in reason
    _, short = decide("precision", [Trial(Candidate(), 0.00498), Trial(Candidate(precision="bf16-mixed"), 0.0131)], 8)
    assert "fp32, eager: 4.98 ms/step = 0.0398 s" in short and "13.1 ms/step = 0.105 s" in short  # not "0.0 s"


def test_an_alternative_within_the_margin_does_not_replace_the_current_setting():
    bf16 = Candidate(precision="bf16-mixed")
    assert decide("precision", [Trial(EAGER, 0.010), Trial(bf16, 0.0097)], planned=100)[0] == EAGER
    assert decide("precision", [Trial(EAGER, 0.010), Trial(bf16, 0.0090)], planned=100)[0] == bf16


def test_a_rejected_or_failed_candidate_is_never_chosen():
    bf16 = Candidate(precision="bf16-mixed")
    rejected = Trial(bf16, 0.001, rejected="its first loss is 9.0% off fp32's")
    chosen, why = decide("precision", [Trial(EAGER, 0.010), rejected], planned=100)
    assert chosen == EAGER and "rejected, its first loss" in why
    failed_current = Trial(EAGER, None, rejected="it failed: RuntimeError")
    assert decide("precision", [failed_current, Trial(bf16, 0.02)], planned=100)[0] == bf16


def conv_task(data=None) -> Task:
    x = torch.randn(16, 1, 8, 8)
    return Task(
        model=lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(144, 2)),
        loss_fn=nn.functional.cross_entropy,
        train_data=data if data is not None else TensorDataset(x, torch.randint(0, 2, (16,))),
        batch_size=8,
    )


class Listed(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.randn(1, 8, 8), i % 2


def test_the_search_tries_only_what_can_win_here():
    on_cpu = dict(search_space(conv_task(), AVX2_CPU))
    assert list(on_cpu) == ["compile", "channels_last", "grad_accum"]  # no fast bf16, data in memory, no CUDA
    assert "no reduced precision" in skipped_axes(conv_task(), AVX2_CPU)["precision"]
    on_gpu = dict(search_space(conv_task(Listed()), H100))
    assert on_gpu["precision"] == ["fp32", "bf16-mixed"]
    assert on_gpu["compile_mode"] == ["default", "reduce-overhead"]
    assert on_gpu["cuda_graphs"] == [False, True]
    assert on_gpu["loader_workers"] == [None, 0], "the rule's own 8 workers (15 cores to spare) are not timed twice"
    mlp = Task(model=nn.Linear(4, 2), loss_fn=nn.functional.mse_loss, train_data=conv_task().train_data, batch_size=7)
    skipped = {"channels_last", "attention", "loader_workers", "grad_accum", "compile_mode", "cuda_graphs"}
    assert set(skipped_axes(mlp, AMX_CPU)) == skipped


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.randn(1, 8, 8), 0)] * 16)


def test_loader_workers_are_not_timed_against_the_rules_own_count_nor_past_one_for_a_stream():
    """On a CPU the rule keeps the loader's 0 workers: 0 was timed against itself and "won" 4.60x by noise. A stream
    was given 4 workers, each reading all of it: 4 times the samples counted as speed, and a user's loop under
    Runtime(plan="tuned") read every sample 4 times."""
    assert dict(search_space(conv_task(Listed()), AMX_CPU))["loader_workers"] == [None, 4]
    for facts in (AMX_CPU, H100):
        assert dict(search_space(conv_task(Stream()), facts))["loader_workers"] == [None, 1], facts.type


def test_graphs_are_tried_uncompiled_against_the_best_and_micro_batches_run_without_them():
    compiled = Candidate(precision="bf16-mixed", compile=True)
    _, graphed = _alternatives(compiled, "cuda_graphs", [False, True])
    assert graphed == Candidate(precision="bf16-mixed", cuda_graphs=True)  # graphs of the model's own forward
    assert graphed.options(RuntimeOptions()).cuda_graphs == "on" and graphed.label == "bf16-mixed, eager, CUDA graphs"
    _, split = _alternatives(graphed, "grad_accum", [1, 2])
    assert split == Candidate(precision="bf16-mixed", grad_accum=2)  # a graphed step back-propagates once


def test_a_tuned_plan_with_graphs_leaves_them_to_the_runs_check_and_an_old_tune_did_not_measure_them():
    tuned = tuned_plan(cuda_graphs=True)
    assert tuned.apply(RuntimeOptions()).cuda_graphs == "auto"  # proposed on CUDA, confirmed on the first steps
    assert tuned.apply(RuntimeOptions(cuda_graphs="off")).cuda_graphs == "off"
    assert "cuda_graphs" not in tuned.plan_reasons(tuned.apply(RuntimeOptions()))  # the run's check says why
    slower = tuned_plan(cuda_graphs=False)
    assert slower.apply(RuntimeOptions()).cuda_graphs == "off"
    assert slower.plan_reasons(slower.apply(RuntimeOptions()))["cuda_graphs"]["value"] is False
    old = tuned_plan().to_dict()
    del old["best"]["cuda_graphs"]
    assert "cuda_graphs" in TunedPlan.from_dict(old).unmeasured
    assert TunedPlan.from_dict(old).apply(RuntimeOptions()).cuda_graphs == "auto"


def tuned_plan(**best) -> TunedPlan:
    return TunedPlan(
        task="t", device="cpu", batch_size=8, planned_steps=100, measured_at="2026-12-01 06:00 UTC",
        best=Candidate(**best), reasons={"precision": "bf16-mixed, 1.40x less time"},
        trials=(Trial(Candidate(), 0.01), Trial(Candidate(precision="bf16-mixed"), None, rejected="it failed")),
    )  # fmt: skip


def test_a_tuned_plan_fills_the_axes_left_to_auto_and_keeps_explicit_ones():
    tuned = tuned_plan(precision="bf16-mixed", compile=True, grad_accum=2)
    applied = tuned.apply(RuntimeOptions())
    assert (applied.precision, applied.compile, applied.grad_accum) == ("bf16-mixed", "on", 2)
    mine = tuned.apply(RuntimeOptions(precision="fp32", compile="off"))
    assert (mine.precision, mine.compile, mine.grad_accum) == ("fp32", "off", 2)
    reasons = tuned.plan_reasons(applied)
    assert reasons["precision"] == {"value": "bf16-mixed", "reason": "bf16-mixed, 1.40x less time"}


def test_a_tuned_nhwc_runs_as_autos_where_auto_lays_that_precision_out_so_and_keeps_the_tunes_reason():
    # "on" handed NHWC outputs to a metric that views them: a run that worked before `redline tune` failed after it
    from devices import CPU_AMX

    tuned = dataclasses.replace(
        tuned_plan(precision="bf16-mixed", channels_last=True), reasons={"channels_last": "NHWC, 1.30x less time"}
    )
    applied = tuned.apply(RuntimeOptions(), CPU_AMX)  # auto lays bf16 convolutions out NHWC on AMX
    assert applied.channels_last == "auto"
    reasons = tuned.plan_reasons(applied)
    assert reasons["channels_last"] == {"value": True, "reason": f"NHWC, 1.30x less time; {LAID_OUT_BY_AUTO}"}
    # resumed, it stays auto: "on" (read from the stored row's True) handed a loss that views them NHWC outputs
    stored = {
        "device": {"value": "cpu"}, "precision": {"value": "bf16-mixed"}, "compile": {"value": False},
        "grad_accum": {"value": 1}, "clip_grad_norm": {"value": None}, **reasons,
    }  # fmt: skip
    assert RuntimeOptions().with_plan(stored).channels_last == "auto"
    fp32_stored = {**stored, "channels_last": {"value": True, "reason": "NHWC, 1.10x less time"}}
    assert RuntimeOptions().with_plan(fp32_stored).channels_last == "on"  # a tuned "on" stays on
    fp32 = Candidate(precision="fp32", channels_last=True)  # auto keeps fp32 NCHW there: only "on" gives NHWC
    assert fp32.options(RuntimeOptions(), CPU_AMX).channels_last == "on"
    assert Candidate(precision="bf16-mixed").options(RuntimeOptions(), CPU_AMX).channels_last == "off"
    assert tuned.apply(RuntimeOptions(channels_last="on"), CPU_AMX).channels_last == "on"  # asked for: as asked
    # the layout was timed in bf16: a run asked for fp32 lays it out as auto does, not NHWC under bf16's reason
    assert tuned.apply(RuntimeOptions(precision="fp32"), CPU_AMX).channels_last == "auto"
    assert tuned.apply(RuntimeOptions(), AVX2_CPU).channels_last == "on"  # bf16 NHWC there: only "on" gives it
    fp32_run = tuned.apply(RuntimeOptions(precision="fp32"), AVX2_CPU)
    assert fp32_run.channels_last == "auto"  # it was "on", under the reason of bf16's timing
    assert "channels_last" not in tuned.plan_reasons(fp32_run)  # auto's reason says why


def test_the_cache_round_trips_and_misses_on_another_machine_or_batch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    tuned = tuned_plan(precision="bf16-mixed")
    path = store_tuned("fingerprint", AMX_CPU, tuned)
    json.loads(Path(path).read_text())  # strict JSON
    assert load_tuned("fingerprint", AMX_CPU, 8) == tuned
    assert load_tuned("fingerprint", AVX2_CPU, 8) is None
    assert load_tuned("fingerprint", AMX_CPU, 16) is None
    assert load_tuned("other model", AMX_CPU, 8) is None
    Path(path).write_text("{not json")
    assert load_tuned("fingerprint", AMX_CPU, 8) is None
    assert "run `redline tune` again" in caplog.text


@pytest.mark.parametrize(("field", "value"), [("precision", "fp64"), ("grad_accum", 0), ("compile_mode", "max")])
def test_a_cached_plan_with_a_setting_no_run_takes_is_unreadable_not_a_flag_error(
    tmp_path, monkeypatch, caplog, field, value
):
    # auto reads the cache on every run: a hand-edited entry must not fail plain `redline train` as a bad --precision
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    path = Path(store_tuned("fingerprint", AMX_CPU, tuned_plan(precision="bf16-mixed")))
    data = json.loads(path.read_text())
    data["best"][field] = value
    path.write_text(json.dumps(data))
    assert load_tuned("fingerprint", AMX_CPU, 8) is None
    assert f"{field}={value!r} is not allowed" in caplog.text and "run `redline tune` again" in caplog.text


BEST = "the best setting's "


def best_with(**settings):
    return lambda data: {**data, "best": {**data["best"], **settings}}


@pytest.mark.parametrize(
    ("damage", "told"),
    [
        (lambda data: [], "the entry is [], not an object"),
        (lambda data: None, "the entry is null, not an object"),
        (lambda data: {**data, "trials": None}, "'trials' is null, not an array"),
        (lambda data: {**data, "unmeasured": "channels_last"}, "'unmeasured' is \"channels_last\", not an array"),
        (lambda data: {k: v for k, v in data.items() if k != "trials"}, "it has no 'trials'"),
        (lambda data: {**data, "trials": [1]}, "trial 1 is 1, not an object"),
        (lambda data: {**data, "reasons": []}, "'reasons' is [], not an object"),
        # each of these was read as it came: a reason of 5 failed every run with a TypeError, a "no" compiled
        (lambda data: {**data, "reasons": {"precision": 5}}, "the reason for 'precision' is 5, not a text"),
        (best_with(compile="no"), BEST + "'compile' is \"no\", not true or false"),
        (best_with(channels_last="yes"), BEST + "'channels_last' is \"yes\", not true or false"),
        (best_with(grad_accum=True), BEST + "'grad_accum' is true, not an integer"),
        (best_with(fast=True), "the best setting has 'fast', which is not a setting a tune makes"),
        (lambda data: {**data, "batch_size": "8"}, "'batch_size' is \"8\", not an integer"),
        (
            lambda data: {**data, "trials": [{"candidate": {"compile": 1}}]},
            "trial 1's candidate's 'compile' is 1, not true or false",
        ),
        (
            lambda data: {**data, "trials": [{"candidate": {}, "compile_cached": "yes"}]},
            "trial 1's 'compile_cached' is \"yes\", not true or false",
        ),
        (
            lambda data: {**data, "trials": [{"candidate": {}, "step_s": "1"}]},
            "trial 1's 'step_s' is \"1\", not a number or null",
        ),
    ],
)
def test_a_damaged_cache_entry_is_named_by_its_field_and_counts_as_none(tmp_path, monkeypatch, caplog, damage, told):
    # "unmeasured" as a string was read letter by letter, and other damage was told as "('trials')"
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    path = Path(store_tuned("fingerprint", AMX_CPU, tuned_plan(precision="bf16-mixed")))
    path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    assert load_tuned("fingerprint", AMX_CPU, 8) is None
    assert f"could not be read ({told})" in caplog.text and "run `redline tune` again" in caplog.text


def test_a_tune_is_found_by_workers_with_fewer_threads(tmp_path, monkeypatch):
    # torchrun starts each worker of `redline train --nproc N` with OMP_NUM_THREADS=1
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    tuned = tuned_plan(precision="bf16-mixed")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    store_tuned("fingerprint", AMX_CPU, tuned, model=nn.Linear(2, 2))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert load_tuned("fingerprint", AMX_CPU, 8) == tuned
    applied, _ = tuned_for_model(nn.Linear(2, 2), AMX_CPU, RuntimeOptions())
    assert applied.precision == "bf16-mixed"


def test_a_bare_runtimes_tune_that_cannot_be_read_is_not_called_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="no tuned Plan for this Linear"):
        tuned_for_model(nn.Linear(2, 2), AMX_CPU, RuntimeOptions())
    store_tuned("fingerprint", AMX_CPU, tuned_plan(precision="bf16-mixed"), model=nn.Linear(2, 2))
    next((tmp_path / "tuned" / "models").glob("*.json")).write_text("{")
    with pytest.raises(ConfigError, match=r"the tuned Plan of this Linear in .* could not be read \(Expecting"):
        tuned_for_model(nn.Linear(2, 2), AMX_CPU, RuntimeOptions())


def test_an_unmeasured_or_rejected_trial_costs_forever():
    assert Trial(Candidate(), None).total_s(10) == float("inf")
    assert Trial(Candidate(), 0.01, rejected="it failed").total_s(10) == float("inf")
    assert Trial(Candidate(compile=True), 0.01, compile_s=5.0).total_s(10) == pytest.approx(5.1)


@pytest.mark.parametrize("below", ["", "sub/dir"])  # the variable names the file, or a folder below it
def test_a_file_where_the_cache_directory_goes_is_no_tune_and_is_named_once_where_a_measurement_is_cached(
    tmp_path, monkeypatch, caplog, below
):
    """Before, every run warned that a tune it never made could not be read, and below the file said to tune again
    (which would fail on the same file); a run that measured a peak twice, and cached a trial, warned three times."""
    blocking = tmp_path / "cache"
    blocking.write_text("not a directory")
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(blocking / below))
    with caplog.at_level(logging.WARNING, logger="redline"):
        assert load_tuned("fingerprint", AMX_CPU, 8) is None
        write_cache("peaks", "key", [0.2])
        write_cache("peaks", "key", [0.3])  # a stalled peak, measured again over more blocks
        write_cache("trials", "key", [])  # the run's trial, cached beside it
    [warning] = [r.getMessage() for r in caplog.records]
    assert f"could not cache the measurement in {blocking / below}/peaks/key.json: {blocking} is a file" in warning
    assert warning.endswith("hint: move it, or point REDLINE_CACHE_DIR at a directory")
    with pytest.raises(
        ConfigError, match=re.escape(f"{blocking} is a file, where the cache's directory goes\nhint: move")
    ):
        check_tuned_cache()  # `redline tune` says so before it searches
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "fresh"))  # an entry that cannot be read: tune again
    store_tuned("fingerprint", AMX_CPU, tuned_plan(precision="bf16-mixed"))
    next((tmp_path / "fresh" / "tuned").glob("*.json")).write_text("{")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="redline"):
        assert load_tuned("fingerprint", AMX_CPU, 8) is None
    assert "run `redline tune` again" in caplog.records[-1].getMessage()


def test_a_graphs_run_that_never_replayed_is_said_to_have_run_its_eager_model():
    # the tune rejects such a candidate: tests/cpu/test_tune_train.py
    from types import SimpleNamespace

    from redline.bench.loops import ran_eagerly
    from redline.plan import Choice

    plan = SimpleNamespace(cuda_graphs=Choice(True, "requested; no training forward replayed yet"), compile=None)
    idle = SimpleNamespace(plan=lambda: plan, runtime=SimpleNamespace(graphed_forwards=0))
    said = ran_eagerly(idle, compiled=False, graphs=True)
    assert said.startswith("the CUDA graphs never replayed, so it would time the eager model (requested; no")
    replayed = SimpleNamespace(plan=lambda: plan, runtime=SimpleNamespace(graphed_forwards=12))
    assert ran_eagerly(replayed, compiled=False, graphs=True) == ""
    assert ran_eagerly(idle, compiled=False) == ""  # an uncompiled, ungraphed candidate is what it says


def test_a_cache_that_cannot_be_written_is_named_once_whichever_kinds_a_run_caches(tmp_path, monkeypatch, caplog):
    # a read-only cache warned once for peaks/ and again for trials/, where the docs say once
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "readonly"))

    def refuse(path):
        raise PermissionError(30, "Read-only file system", str(path.parent))

    monkeypatch.setattr(cache_module, "make_parent", refuse)
    with caplog.at_level(logging.WARNING, logger="redline"):
        write_cache("peaks", "key", [0.2])
        write_cache("trials", "key", [])
    [warning] = [r.getMessage() for r in caplog.records]
    assert f"could not cache the measurement in {tmp_path / 'readonly'}/peaks/key.json" in warning


def test_a_loader_worker_count_is_said_in_the_singular_for_one():
    from redline.bench.tune import _value

    assert _value(Candidate(precision="fp32", loader_workers=1), "loader_workers") == "1 loader worker"
    assert _value(Candidate(precision="fp32", loader_workers=4), "loader_workers") == "4 loader workers"
