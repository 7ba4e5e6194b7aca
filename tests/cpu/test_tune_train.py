"""`redline tune` finds and caches a Plan; `redline train --plan tuned` and auto run it, and a resumed run keeps it."""

import dataclasses
import functools
import json
import logging
import math
import re
import shlex
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline.runtime.fused as fused
import redline.runtime.graphs as graphs_home
import redline.runtime.runtime as runtime_home
from dropped_interrupts import DropsItsInterrupt
from graph_standins import Capture
from redline.bench.tune import UNMEASURED, _measure, decide, tune
from redline.bench.tune_cache import TuneInterrupted
from redline.bench.tune_space import refused_split
from redline.cli.tune import tune_command
from redline.errors import ConfigError, StoppedBySignal, TaskError, Terminated, TrainingError
from redline.hardware.device import FAKE_CPU_ENV, probe_device
from redline.parallel.env import DistEnv, read_env
from redline.plan import Choice
from redline.runtime.options import RuntimeOptions
from redline.runtime.runtime import Runtime
from redline.runtime.trial import time_steps
from redline.runtime.tuned import Candidate, Trial, TunedPlan, store_tuned
from redline.runtime.tuned_run import find_tuned, split_differs
from redline.task import Task, load_task
from redline.train.config import TrainerConfig
from redline.train.trainer import Trainer
from redline.train.tuned import use_tuned


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    # A tuned Plan in the suite's shared cache would change other tests' auto runs.
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def compiles_tried(monkeypatch):
    """The tests of what a search does with its compile axis weigh runs of a tiny MLP (under a second eagerly), which
    no compile could make shorter: the search would not try one (``LEAST_COMPILE_S``)."""
    monkeypatch.setattr("redline.bench.tune.LEAST_COMPILE_S", 0.0)


def mlp_task() -> Task:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, 8, generator=generator), torch.randint(0, 3, (128,), generator=generator)
    return Task(
        model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)),
        loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x, y), batch_size=32, name="mlp",
    )  # fmt: skip


def measured_entries(cache: Path) -> list[Path]:
    """What a tune cached of its own measurements: the optimizer's step timing at setup aside (runtime/fused.py),
    which holds for the optimizer whatever the tune made of the model."""
    return [path for path in cache.rglob("*.json") if path.parent.name != fused.CACHED]


def test_a_task_no_candidate_can_run_is_refused_and_no_plan_is_cached(tmp_path):
    task = dataclasses.replace(mlp_task(), model=lambda: nn.Linear(7, 3))  # the data has 8 features
    torch.manual_seed(1234)
    with pytest.raises(TrainingError, match=r"no candidate of mlp ran \(\d+ tried\); fp32, eager: it failed: Runtime"):
        tune(task, devices="cpu", budget_s=5, steps=1, window=1)
    assert not measured_entries(tmp_path / "cache")  # `--plan tuned` finds nothing made of failures
    drawn = torch.rand(3)  # its candidates seed torch: the caller's random stream goes on as it was, raised or not
    torch.manual_seed(1234)
    assert torch.equal(drawn, torch.rand(3))


def test_a_budget_spent_before_the_first_axis_is_refused_by_its_flag_and_nothing_is_cached(tmp_path):
    with pytest.raises(ConfigError, match=r"--budget=1e-09 is not allowed; .*\nhint: e\.g\. --budget 120"):
        tune_command(task="example:digits", budget=1e-9)
    assert not measured_entries(tmp_path / "cache")


def test_a_batch_size_larger_than_the_data_is_refused_before_the_search_naming_the_largest(monkeypatch):
    monkeypatch.setattr("redline.bench.tune._measure", lambda *args: pytest.fail("the search ran"))
    with pytest.raises(TaskError, match=r"fewer than the batch size 500\nhint: pass batch sizes up to 128 \(--batch"):
        tune(mlp_task(), devices="cpu", batch_size=500)


def test_a_list_of_devices_is_refused_with_a_hint_to_tune_one_at_a_time(monkeypatch):
    monkeypatch.setattr("redline.bench.tune._measure", lambda *args: pytest.fail("the search ran"))
    with pytest.raises(ConfigError, match=r"--devices='cpu,cuda' is not allowed; expected one device: .*\nhint: tune "
                                          r"one at a time, e\.g\. --devices 'cpu'"):  # fmt: skip
        tune_command(task="example:digits", devices="cpu,cuda")


def test_a_cache_the_tune_cannot_be_stored_in_is_refused_before_the_search(tmp_path, monkeypatch):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(not_a_folder))
    monkeypatch.setattr("redline.bench.tune._measure", lambda *args: pytest.fail("the search ran"))
    told = r"cannot be cached in .*file/tuned: .*file is a file, where the cache.s directory goes\nhint: move it"
    with pytest.raises(ConfigError, match=told):
        tune(mlp_task(), devices="cpu", budget_s=5)


def cache_plan(task: Task, planned_steps: int = 500, **best) -> TunedPlan:
    """A tuned Plan as `redline tune` would cache it for this machine, with made-up numbers."""
    tuned = TunedPlan(
        task=task.name, device="cpu", batch_size=task.batch_size, planned_steps=planned_steps,
        measured_at="2026-12-01 06:00 UTC", best=Candidate(**best),
        reasons={"grad_accum": "2 micro-batches per step, 1.20x less time for 500 steps (made up)"},
        trials=(Trial(Candidate(), 0.002),),
    )  # fmt: skip
    store_tuned(task.fingerprint(), probe_device(torch.device("cpu")), tuned)
    return tuned


def test_plan_tuned_without_a_tune_says_how_to_make_one():
    task = mlp_task()
    with pytest.raises(ConfigError, match=f"run `redline tune --task SPEC --batch-size {task.batch_size}` first"):
        Trainer(task, TrainerConfig(max_steps=2, plan="tuned", progress=False)).fit()


def test_plan_tuned_without_a_tune_says_the_tune_command_with_the_task_as_typed():
    from typer.testing import CliRunner

    from redline.cli.main import app

    args = ["train", "--task", "example:chargpt", "--task-arg", "n_layer=1", "--plan", "tuned", "--max-steps", "1"]
    result = CliRunner().invoke(app, [*args, "--batch-size", "4"])
    assert isinstance(result.exception, ConfigError), result.output
    hint = str(result.exception).split("\nhint: ")[-1]
    assert hint.startswith("run `redline tune --task example:chargpt --task-arg n_layer=1 --batch-size 4` first")
    result = CliRunner().invoke(app, [*args, "--batch-size", "4", "--devices", "cpu"])  # a GPU machine tunes cuda
    tune = "`redline tune --task example:chargpt --task-arg n_layer=1 --batch-size 4 --devices cpu` first"
    assert str(result.exception).split("\nhint: ")[-1].startswith(f"run {tune}")


def test_a_tuned_micro_batch_keeps_the_batch_per_step_and_survives_a_resume(tmp_path):
    task = mlp_task()
    cache_plan(task, grad_accum=2)
    config = TrainerConfig(max_steps=3, plan="tuned", progress=False, out_dir=tmp_path / "run", checkpoint_every=3)
    with Trainer(task, config) as trainer:
        first = trainer.fit()
    assert trainer.batch_size == 16 and first.samples == 3 * 32  # two micro-batches of 16 per step
    grad_accum = first.plan.to_dict()["grad_accum"]
    assert grad_accum["value"] == 2 and grad_accum["reason"].startswith("tuned 2026-12-01 06:00 UTC for 500 steps")
    assert "; global batch 32 = 2 micro-batches x 1 x 16" in first.plan.loader.reason  # it said "global batch 16"
    with Trainer(task, dataclasses.replace(config, max_steps=5, resume="auto")) as again:
        resumed = again.fit()
    assert again.batch_size == 16 and resumed.steps == 5 and resumed.samples == 5 * 32


def test_a_tune_that_kept_one_batch_per_step_says_so_in_the_plan_tuned_runs():
    # The row read "default: a step per batch", where the tune had timed 2 micro-batches and kept one (README: --plan
    # tuned "says so in every reason, with the numbers")
    task = mlp_task()
    tuned = TunedPlan(
        task=task.name, device="cpu", batch_size=task.batch_size, planned_steps=4, measured_at="2026-12-07 20:00 UTC",
        best=Candidate(), reasons={"grad_accum": "one batch per step kept (7.81 ms/step; 2 micro-batches: 10.4)"},
        trials=(Trial(Candidate(), 0.002),),
    )  # fmt: skip
    store_tuned(task.fingerprint(), probe_device(torch.device("cpu")), tuned)
    with Trainer(task, TrainerConfig(max_steps=4, plan="tuned", progress=False)) as trainer:
        row = trainer.fit().plan.grad_accum
    assert (
        row.value == 1
        and row.reason.startswith("tuned 2026-12-07 20:00 UTC")
        and "one batch per step kept" in row.reason
    )


def test_grad_accum_asked_as_the_tune_chose_it_runs_whole_batches_and_resumes_so(tmp_path):
    # --grad-accum 2 runs two whole batches a step; the tune's 2 splits one. The tune's reason went with the run's
    # value, so the resume halved the batch and was refused, its hint naming twice the batch the run had.
    task = mlp_task()
    cache_plan(task, grad_accum=2)
    config = TrainerConfig(max_steps=2, plan="tuned", runtime=RuntimeOptions(grad_accum=2), progress=False,
                           out_dir=tmp_path / "run", checkpoint_every=2)  # fmt: skip
    with Trainer(task, config) as trainer:
        first = trainer.fit()
    assert trainer.batch_size == 32 and first.samples == 2 * 64
    assert "; global batch 64 = 2 micro-batches x 1 x 32" in first.plan.loader.reason
    assert "tuned" not in first.plan.to_dict()["grad_accum"]["reason"]
    with Trainer(task, dataclasses.replace(config, max_steps=4, resume="auto")) as again:
        resumed = again.fit()
    assert again.batch_size == 32 and resumed.steps == 4 and resumed.samples == 4 * 64


def test_a_tuned_micro_batch_the_processes_cannot_share_is_not_taken_and_the_plan_says_why(caplog):
    # A one-process tune split a batch of 18 in two; `train --nproc 2` found it (its key has no thread count) and
    # halved the batch to 9, which two processes cannot share: refused as if --batch-size 9 were the user's flag.
    task = dataclasses.replace(mlp_task(), batch_size=18)
    cache_plan(task, grad_accum=2)
    config = TrainerConfig(max_steps=2, plan="tuned", progress=False)
    with caplog.at_level(logging.INFO, logger="redline"):
        found = use_tuned(task, config.runtime, 18, DistEnv(rank=0, world_size=2), config=config)
    assert found is not None and (found.batch_size, found.options.grad_accum) == (18, 1)
    told = (
        "the tune's 2 micro-batches per step of batch 18 not taken: its micro-batch of 9 does not split across the 2 "
        "processes; each step runs the whole batch"
    )
    assert found.tuning.reasons["grad_accum"] == {"value": 1, "reason": told}
    assert f"tuned 2026-12-01 06:00 UTC for 500 steps: {told}" in caplog.text
    one = use_tuned(task, config.runtime, 18, DistEnv(), config=config)  # one process runs the tune's micro-batches
    assert one is not None and (one.batch_size, one.options.grad_accum) == (9, 2)
    twenty = dataclasses.replace(task, batch_size=20)
    cache_plan(twenty, grad_accum=2)  # micro-batches of 10: two processes share them
    shared = use_tuned(twenty, config.runtime, 20, DistEnv(rank=0, world_size=2), config=config)
    assert shared is not None and (shared.batch_size, shared.options.grad_accum) == (10, 2)


@pytest.mark.parametrize("plan", ["tuned", "auto"])
def test_grad_accum_given_as_1_wins_over_a_tuned_micro_batching(plan):
    # an explicit flag wins: --grad-accum 1, the default's value, read as left to auto, and the tune split the batch
    task = mlp_task()
    cache_plan(task, planned_steps=2, precision="fp32", grad_accum=2)
    config = TrainerConfig(max_steps=2, plan=plan, progress=False, runtime=RuntimeOptions(grad_accum=1))
    with Trainer(task, config) as trainer:
        summary = trainer.fit()
    assert trainer.batch_size == 32 and summary.plan.grad_accum.value == 1 and summary.samples == 2 * 32
    assert "tuned" not in summary.plan.grad_accum.reason


def test_a_tuned_micro_batching_that_would_leave_samples_untrained_or_step_them_otherwise_is_not_taken(caplog):
    # 24 samples at batch 16 split in two: 3 micro-batches, 1 step, the last 8 samples untrained each epoch, and the
    # warning told the user to pass a --grad-accum that divides 3, a flag they had never passed. Over 2 epochs the 6
    # micro-batches made 3 steps, the third of the first epoch's last 8 samples and the next's first 8, where whole
    # batches step 16, then 8 (each weighing 1/8 of the loss, not 1/16)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 8, generator=generator), torch.randint(0, 3, (24,), generator=generator))
    task = dataclasses.replace(mlp_task(), train_data=data, batch_size=16, epochs=1)
    cache_plan(task, planned_steps=2, precision="fp32", grad_accum=2)
    for epochs in (1, 2):
        with (
            caplog.at_level(logging.INFO, logger="redline"),
            Trainer(dataclasses.replace(task, epochs=epochs), TrainerConfig(progress=False)) as trainer,
        ):
            summary = trainer.fit()
        assert trainer.batch_size == 16 and summary.samples == 24 * epochs and summary.plan.grad_accum.value == 1
        told = "2 micro-batches per step of batch 16 not taken: an epoch of 24 samples ends in a batch of 8, not 16"
        assert told in summary.plan.grad_accum.reason and told in caplog.text
    assert "--grad-accum" not in caplog.text
    whole = dataclasses.replace(task, train_data=TensorDataset(*mlp_task().train_data[:32]), epochs=2)
    cache_plan(whole, planned_steps=4, precision="fp32", grad_accum=2)
    with Trainer(whole, TrainerConfig(progress=False)) as trainer:  # 32 samples: 2 whole batches, 4 micro-batches
        summary = trainer.fit()
    assert trainer.batch_size == 8 and summary.plan.grad_accum.value == 2 and summary.samples == 64


def test_a_tuned_micro_batching_of_a_model_with_batchnorm_is_not_taken():
    # its statistics would be over micro-batches of 16, not the batch of 32: step 1's loss moved (1.23557 for 1.23809)
    task = dataclasses.replace(
        mlp_task(), model=lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    )
    cache_plan(task, planned_steps=4, precision="fp32", grad_accum=2)
    config = TrainerConfig(plan="tuned", progress=False)
    kept = use_tuned(task, config.runtime, 32, DistEnv(), config=config)
    assert kept is not None and (kept.batch_size, kept.options.grad_accum) == (32, 1)
    told = "the model's 1 BatchNorm layer(s) would take their statistics over micro-batches of 16, not over the batch"
    assert told in kept.tuning.reasons["grad_accum"]["reason"]
    assert refused_split(task, Candidate(), 2) and not refused_split(mlp_task(), Candidate(), 2)  # the tune's too


def untrained_task(size: int, batch_size: int = 16) -> Task:
    """mlp_task's samples cut to ``size``, for one epoch at ``batch_size``."""
    x, y = mlp_task().train_data.tensors
    data = TensorDataset(x[:size], y[:size])
    return dataclasses.replace(mlp_task(), train_data=data, batch_size=batch_size, epochs=1)


def test_a_compiled_tuned_micro_batching_is_taken_where_whole_batches_drop_the_same_samples():
    # A compiled run keeps one shape, dropping its partial last batch: 36 samples train as 2 whole batches of 16 (32
    # samples) or 4 micro-batches of 8 (2 steps, the same 32). The split was refused, as if 5 micro-batches of 8
    # left the last one untrained "where the whole batches train on every sample".
    task = untrained_task(36)
    cache_plan(task, precision="fp32", compile=True, grad_accum=2)
    config = TrainerConfig(plan="tuned", progress=False)
    found = use_tuned(task, config.runtime, 16, DistEnv(), config=config)
    assert found is not None and (found.batch_size, found.options.grad_accum) == (8, 2)
    eager = RuntimeOptions(compile="off")  # eager keeps the partial batch: the split would leave 4 samples out
    kept = use_tuned(task, eager, 16, DistEnv(), config=dataclasses.replace(config, runtime=eager))
    assert kept is not None and (kept.batch_size, kept.options.grad_accum) == (16, 1)
    assert "an epoch of 36 samples ends in a batch of 4, not 16" in kept.tuning.reasons["grad_accum"]["reason"]
    assert not refused_split(task, Candidate(compile=True), 2) and refused_split(task, Candidate(), 2)  # the tune's too
    # 12 samples, fewer than a batch of 16: compiled, the whole batch of 12 trains each epoch (no whole batch to keep),
    # where micro-batches of 8 drop 4 and step across epochs; taken, as 0 whole batches "dropped" nothing
    small = untrained_task(12)
    for epochs, steps in ((2.0, None), (math.inf, 5)):
        assert "ends in a batch of 12, not 16" in split_differs(
            small, 16, 2, 1, epochs=epochs, max_steps=steps, drop_last=True
        )


def test_a_tune_does_not_offer_micro_batches_the_run_it_prints_would_leave_out(monkeypatch, capsys):
    # digits' 1438 samples in micro-batches of 32 make 45 an epoch: `train --plan tuned` runs whole batches, yet the
    # tune measured and chose 2 micro-batches and printed "use it: redline train --plan tuned".
    measured = []

    def split_faster(task, device, candidates, planned, steps, window, seed, budget_s):
        measured.extend(candidates)
        return [Trial(c, 0.010 / c.grad_accum) for c in candidates]

    monkeypatch.setattr(
        "redline.bench.tune.search_space", lambda task, facts, **_: [("compile", [False, True]), ("grad_accum", [1, 2])]
    )
    monkeypatch.setattr("redline.bench.tune._measure", split_faster)
    tuned, _ = tune(untrained_task(24), devices="cpu", budget_s=60)  # 3 micro-batches of 8: 1 step, 8 samples left
    assert tuned.best.grad_accum == 1 and all(c.grad_accum == 1 for c in measured)
    assert tuned.reasons["grad_accum"] == (
        "one batch per step kept, 2 micro-batches per step not tried: `redline train --plan tuned` would not take "
        "them, as for the task's 1 epoch(s) they would not train as whole batches do (an epoch of 24 samples ends in "
        "a batch of 8, not 16, which micro-batches of 8 would step otherwise than the whole batch: in micro-batches of "
        "unequal size, each weighing alike, or together with the next epoch's first)"
    )
    split, _ = tune(untrained_task(32), devices="cpu", budget_s=60)  # 4 micro-batches of 8: 2 whole steps
    assert split.best.grad_accum == 2
    # --planned-steps 1 prints `train --max-steps 1 --plan tuned`, whose one step is a whole batch: it takes the
    # split, which was refused for the task's epoch the run never reaches the end of
    short, _ = tune(untrained_task(24), devices="cpu", budget_s=60, planned_steps=1)
    assert short.best.grad_accum == 2, short.reasons["grad_accum"]
    config = TrainerConfig(plan="tuned", max_steps=1, progress=False)
    taken = use_tuned(untrained_task(24), config.runtime, 16, DistEnv(), config=config)
    assert taken is not None and (taken.batch_size, taken.options.grad_accum) == (8, 2)  # train's rule agrees
    longer, _ = tune(untrained_task(24), devices="cpu", budget_s=60, planned_steps=2)  # the step on the 8 left
    assert longer.best.grad_accum == 1 and "as for --max-steps 2 they would not train" in longer.reasons["grad_accum"]


def test_a_flag_given_its_defaults_value_under_auto_says_the_cached_tune_is_not_taken(caplog):
    # --grad-accum 1 counts as given, so auto left the whole tune (its compile, workers, precision) without a word
    task = mlp_task()
    config = TrainerConfig(max_steps=2, progress=False, runtime=RuntimeOptions(grad_accum=1, compile_mode="default"))
    with caplog.at_level(logging.INFO, logger="redline"):
        assert use_tuned(task, config.runtime, 32, read_env(), config=config) is None
    assert "is cached" not in caplog.text  # no tune: nothing to say
    cache_plan(task, planned_steps=2, precision="fp32", grad_accum=2)
    with caplog.at_level(logging.INFO, logger="redline"):
        summary = Trainer(task, config).fit()
    assert summary.plan.grad_accum.value == 1 and summary.plan.grad_accum.reason == "requested"
    assert (
        "a tune of task 'mlp' is cached (tuned 2026-12-01 06:00 UTC for 2 steps), but --compile-mode default and "
        "--grad-accum 1 were given: auto takes a tune only where every axis it tunes is left to auto, so auto's own "
        "rules decide (--plan tuned runs the tune, your flags winning)"
    ) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="redline"):
        left = Trainer(task, TrainerConfig(max_steps=2, progress=False, runtime=RuntimeOptions(grad_accum=None))).fit()
    assert left.plan.grad_accum.value == 2 and "is cached" not in caplog.text  # left out: the tune runs


def test_a_resume_of_a_tuned_micro_batch_at_another_batch_size_names_the_batch_to_pass(tmp_path):
    task = mlp_task()
    cache_plan(task, grad_accum=2)
    config = TrainerConfig(max_steps=2, plan="tuned", progress=False, out_dir=tmp_path / "run", checkpoint_every=2)
    with Trainer(task, config) as trainer:
        trainer.fit()  # batches of 32 as two micro-batches of 16
    again = dataclasses.replace(config, max_steps=4, resume="auto", batch_size=64)  # micro-batches of 32
    with pytest.raises(ConfigError, match=r"batches of 16, and this run's are 32.*\nhint: resume with --batch-size 32"):
        Trainer(task, again).fit()  # --batch-size 16 would split into 8s, and be refused again


def test_auto_takes_a_cached_tuned_plan_unless_an_axis_was_chosen():
    task = mlp_task()
    cache_plan(task, planned_steps=2, precision="fp32", grad_accum=2)
    auto = Trainer(task, TrainerConfig(max_steps=2, progress=False)).fit()
    assert auto.plan.grad_accum.value == 2 and "tuned" in auto.plan.grad_accum.reason
    chosen = TrainerConfig(max_steps=2, progress=False, runtime=RuntimeOptions(compile="off"))
    mine = Trainer(task, chosen).fit()
    assert mine.plan.grad_accum.value == 1 and "tuned" not in json.dumps(mine.plan.to_dict())


@pytest.mark.parametrize("trial", ["on", "fresh"])
def test_trial_on_or_fresh_measures_instead_of_taking_a_cached_tuned_plan(caplog, trial):
    # Before, --trial fresh under a cached tune ran the tune's Plan and measured nothing, without a word.
    task = mlp_task()
    cache_plan(task, planned_steps=2, precision="fp32", grad_accum=2)
    with caplog.at_level(logging.INFO, logger="redline"):
        summary = Trainer(task, TrainerConfig(max_steps=2, progress=False, trial=trial)).fit()
    assert summary.plan.grad_accum.value == 1 and "tuned" not in json.dumps(summary.plan.to_dict())
    assert f"--trial {trial}: auto measures now instead of running the tuned Plan (tuned " in caplog.text
    tuned = Trainer(task, TrainerConfig(max_steps=2, progress=False, plan="tuned", trial=trial)).fit()
    assert tuned.plan.grad_accum.value == 2, "--plan tuned asks for the tune's Plan: it runs"


@pytest.mark.parametrize(("steps", "taken"), [(2, False), (250, True), (500, True), (1000, True), (1001, False)])
def test_auto_leaves_a_tune_weighed_for_a_run_of_another_length_to_its_own_rules(caplog, steps, taken):
    # a compile that did not repay 500 steps may repay 100,000: auto took the tune whatever the run's length
    task = mlp_task()
    cache_plan(task, planned_steps=500, precision="fp32", grad_accum=2)
    config = TrainerConfig(max_steps=steps, progress=False)
    with caplog.at_level(logging.INFO, logger="redline"):
        found = use_tuned(task, config.runtime, task.batch_size, read_env(), config=config)
    assert (found is not None) == taken
    told = f"a tune of task 'mlp' is cached (tuned 2026-12-01 06:00 UTC for 500 steps), but this run plans {steps} "
    assert (told in caplog.text) == (not taken), caplog.text
    asked = TrainerConfig(max_steps=steps, progress=False, plan="tuned")  # --plan tuned runs it whatever the length
    assert use_tuned(task, asked.runtime, task.batch_size, read_env(), config=asked) is not None
    if steps == 2:
        summary = Trainer(task, config).fit()
        assert summary.plan.grad_accum.value == 1 and "tuned" not in json.dumps(summary.plan.to_dict())


@pytest.mark.usefixtures("compiles_tried")
def test_tune_measures_the_axes_and_caches_what_train_then_runs(monkeypatch):
    task = mlp_task()
    lookups = iter(range(1000))  # torch's on-disk caches served every compile, as on a machine that compiled it before
    monkeypatch.setattr("redline.bench.tune.cache_lookups", lambda: (next(lookups), 0))
    tuned, path = tune(task, devices="cpu", budget_s=60, planned_steps=100, steps=4, window=2)
    assert path.endswith(".json")
    searched = {"compile", "grad_accum"}  # an MLP on in-memory tensors; precision too where bf16 is fast
    assert searched <= set(tuned.reasons)
    assert tuned.reasons["channels_last"].startswith("not searched here: the model has no 2-d convolution")
    assert all(t.step_s is not None and t.step_s > 0 for t in tuned.trials if not t.rejected)
    assert {t.candidate.compile for t in tuned.trials} == {False, True}
    # such a compile is said to be one (a machine that never compiled the model pays a cold one)
    assert all(t.compile_cached is t.candidate.compile for t in tuned.trials if not t.rejected)
    assert re.search(
        r"compiled \(default\): [\d.]+ ms/step \+ [\d.]+ s compile \(cached on disk\)", tuned.reasons["compile"]
    )
    summary = Trainer(task, TrainerConfig(max_steps=2, plan="tuned", progress=False)).fit()
    assert summary.plan.precision.value == tuned.best.precision
    assert summary.plan.compile.value is tuned.best.compile
    assert summary.plan.compile.reason.startswith("tuned")
    with Runtime(devices="cpu", plan="tuned") as rt:  # the bare Runtime finds the same tune by the model
        rt.setup(task.build_model(), task.optimizer)
        assert rt.explain().compile.value is tuned.best.compile and rt.precision.name == tuned.best.precision


def test_a_bare_runtime_runs_the_tuned_plan_of_its_model_and_tells_micro_batching():
    task = mlp_task()
    tuned = cache_plan(task, precision="bf16-mixed", grad_accum=2)
    store_tuned(task.fingerprint(), probe_device(torch.device("cpu")), tuned, model=task.build_model())
    with Runtime(devices="cpu", plan="tuned") as rt:
        rt.setup(task.build_model(), task.optimizer)
        plan = rt.explain()
    assert rt.precision.name == "bf16-mixed" and plan.precision.value == "bf16-mixed"
    assert plan.precision.reason.startswith("tuned 2026-12-01 06:00 UTC at batch 32 for 500 steps")
    assert plan.grad_accum.value == 1 and "split each in 2 and pass grad_accum=2" in plan.grad_accum.reason
    ranked = task.build_model()
    ranked.device_name = "cuda:1"  # a setting a rank keeps of its own: each rank of a job must find the tune
    with Runtime(devices="cpu", plan="tuned") as rt:
        rt.setup(ranked, task.optimizer)
        assert rt.precision.name == "bf16-mixed"
    other = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3))
    with pytest.raises(ConfigError, match="run `redline tune --task SPEC` on a Task with this model"):
        Runtime(devices="cpu", plan="tuned").setup(other, torch.optim.SGD(other.parameters(), lr=0.1))


def test_a_tuned_worker_count_is_told_as_the_tunes_not_as_requested(tmp_path):
    """The loader row of a run on a tuned Plan read "requested", with the tune's figures gone."""
    task = mlp_task()
    tuned = cache_plan(task, loader_workers=1)
    tuned = dataclasses.replace(tuned, reasons={"loader_workers": "1 loader workers, 1.30x less time (made up)"})
    store_tuned(task.fingerprint(), probe_device(torch.device("cpu")), tuned)
    store_tuned(task.fingerprint(), probe_device(torch.device("cpu")), tuned, model=task.build_model())
    with Trainer(task, TrainerConfig(max_steps=1, plan="tuned", progress=False)) as trainer:
        loader = trainer.fit().plan.to_dict()["loader"]
    assert loader["value"].startswith("workers=1") and loader["reason"].startswith("tuned 2026-12-01 06:00 UTC for 500")
    assert "1.30x less time (made up)" in loader["reason"]
    with Runtime(devices="cpu", plan="tuned") as rt:
        rt.setup(task.build_model(), task.optimizer)
        rt.setup_loader(torch.utils.data.DataLoader(task.train_data, batch_size=32))
        assert "1.30x less time (made up)" in rt.explain().loader.reason
    asking = TrainerConfig(max_steps=1, plan="tuned", progress=False, runtime=RuntimeOptions(loader_workers=0))
    with Trainer(task, asking) as asked:
        assert asked.fit().plan.to_dict()["loader"]["reason"].startswith("requested"), "a request wins, and says so"


def test_no_candidate_starts_once_the_budget_is_spent(monkeypatch):
    # A compile cannot be cut short, so the budget is kept by not starting one (nor any warm-up) past it: the axis's
    # current setting is warmed up, the alternative is said to be unmeasured, not rejected; and the current is not
    # timed alone, two rounds past the budget that decided nothing.
    monkeypatch.setattr("redline.bench.tune.time_runners", lambda *args: pytest.fail("the current was timed alone"))
    current, compiled = _measure(mlp_task(), "cpu", [Candidate(), Candidate(compile=True)], 100, steps=2, window=1,
                                 seed=0, budget_s=1e-9)  # fmt: skip
    assert current.step_s is None and current.rejected == UNMEASURED
    assert compiled.step_s is None and compiled.rejected == "not measured: the budget was spent"
    _, reason = decide("compile", [current, compiled], 100)
    assert reason.startswith("compile off kept (fp32, eager: not measured: the budget was spent; fp32, compiled")
    assert "compiled (default): not measured: the budget" in reason and "rejected" not in reason


def test_a_search_that_ran_past_its_budget_says_by_how_much_and_why(monkeypatch):
    def slow_compile(task, device, candidates, planned, steps, window, seed, budget_s):
        time.sleep(0.3)  # a compile that outlasts the whole budget
        return [Trial(c, 0.010, compile_s=0.3 if c.compile else 0.0) for c in candidates]

    monkeypatch.setattr(
        "redline.bench.tune.search_space", lambda task, facts, **_: [("compile", [False, True]), ("grad_accum", [1, 2])]
    )
    monkeypatch.setattr("redline.bench.tune._measure", slow_compile)
    tuned, _ = tune(mlp_task(), devices="cpu", budget_s=0.1)  # grad_accum was not measured: left to auto
    spent = tuned.reasons["budget"]  # a row of the tune's table, and of its --json
    over = r"searched in 0\.[3-9]\d* s, 0\.[2-8]\d* s over the 0\.1 s budget: a warm-up once begun is not cut short"
    left = r"; grad_accum left to auto: about \d+0 s would measure every axis"
    assert re.fullmatch(over + r".*; the longest compile took 0\.3 s \(fp32, compiled \(default\)\)" + left, spent), (
        spent
    )
    assert tuned.reasons["grad_accum"] == "not measured: the 0.1 s budget was spent; left to the run's auto"
    within, _ = tune(mlp_task(), devices="cpu", budget_s=60)
    assert re.fullmatch(r"searched in \d\.\d+ s of the 60 s budget", within.reasons["budget"])


def interrupted_at(axis, by: KeyboardInterrupt | type[KeyboardInterrupt] = KeyboardInterrupt):
    def measure(task, device, candidates, planned, steps, window, seed, budget_s):
        if candidates[1:] and getattr(candidates[1], axis) != getattr(candidates[0], axis):
            raise by  # Ctrl-C (or SIGTERM, as the command line raises it) in the middle of this axis's measurement
        return [Trial(c, 0.010 if c.precision == "fp32" else 0.005) for c in candidates]

    return measure


@pytest.mark.usefixtures("compiles_tried")
def test_a_sigterm_the_command_line_takes_caches_what_was_measured_as_a_ctrl_c_does_and_exits_143(monkeypatch):
    space = [("precision", ["fp32", "bf16-mixed"]), ("compile", [False, True])]
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    monkeypatch.setattr("redline.bench.tune._measure", interrupted_at("compile", Terminated(signal.SIGTERM)))
    with pytest.raises(TuneInterrupted) as stopped:
        tune(mlp_task(), devices="cpu", planned_steps=100)
    assert stopped.value.exit_code == 143 and str(stopped.value).startswith("tune interrupted by SIGTERM")
    assert stopped.value.tuned.best == Candidate(precision="bf16-mixed")  # what was measured is kept
    assert stopped.value.tuned.reasons["compile"].startswith("not measured: the search was interrupted (SIGTERM)")


@pytest.mark.usefixtures("compiles_tried")
def test_a_ctrl_c_python_dropped_inside_an_axis_still_stops_the_tune_there(monkeypatch):
    """Python drops a KeyboardInterrupt raised in a weakref callback or __del__ (torch's compile runs many): the
    search ran on to the end, cached it and exited 0, once in about 20 Ctrl-Cs during a cold compile."""
    space = [("precision", ["fp32", "bf16-mixed"]), ("compile", [False, True]), ("grad_accum", [1, 2])]
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    monkeypatch.setattr("sys.unraisablehook", lambda unraisable: None)  # Python's "Exception ignored in", unsaid

    def measure(task, device, candidates, planned, steps, window, seed, budget_s):
        if candidates[1].compile:
            DropsItsInterrupt(signal.SIGINT)  # the Ctrl-C lands inside a callback of the compile, and is dropped
        return [Trial(c, 0.010 if c.precision == "fp32" else 0.005) for c in candidates]

    monkeypatch.setattr("redline.bench.tune._measure", measure)
    with pytest.raises(TuneInterrupted) as stopped:
        tune(mlp_task(), devices="cpu", planned_steps=100)
    tuned = stopped.value.tuned
    assert stopped.value.exit_code == 130 and tuned.best == Candidate(precision="bf16-mixed")
    assert tuned.reasons["compile"].startswith("not measured: the search was interrupted (SIGINT)")
    assert tuned.reasons["grad_accum"].startswith("not measured: the search was interrupted (SIGINT)")


def test_a_compile_is_not_tried_for_a_run_shorter_eagerly_than_any_compile_takes(monkeypatch):
    """A tiny model's planned run of a tenth of a second spent most of a 20 s budget compiling, which could not win."""
    space = [("precision", ["fp32", "bf16-mixed"]), ("compile", [False, True])]
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    tried = []

    def measure(task, device, candidates, planned, steps, window, seed, budget_s):
        tried.extend(candidates)

        def step_s(c: Candidate) -> float:  # a compile makes the step 0.6x as long
            return (0.010 if c.precision == "fp32" else 0.005) * (0.6 if c.compile else 1.0)

        return [Trial(c, step_s(c), compile_s=0.2 * c.compile) for c in candidates]

    monkeypatch.setattr("redline.bench.tune._measure", measure)
    short, _ = tune(mlp_task(), devices="cpu", planned_steps=100)  # bf16's 100 steps: 0.5 s eagerly
    assert not any(c.compile for c in tried) and short.best == Candidate(precision="bf16-mixed")
    assert short.reasons["compile"].startswith(
        "compile off kept, not tried: the planned 100 steps take 0.50 s eagerly, less than any compile takes "
        "(1 s at least, torch's caches warm);"
    )
    assert "compile" not in short.unmeasured  # decided: a run that uses the tune stays eager
    tried.clear()
    longer, _ = tune(mlp_task(), devices="cpu", planned_steps=1000)  # 5 s eagerly: a compile might win
    assert any(c.compile for c in tried) and longer.best.compile  # here the fake compile of 0.2 s repays itself


def cached_plans(tmp_path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (tmp_path / "cache" / "tuned").glob("*.json")]


@pytest.mark.usefixtures("compiles_tried")
def test_a_ctrl_c_caches_what_was_measured_leaves_the_rest_to_auto_and_exits_130(tmp_path, monkeypatch, capsys):
    # compile "kept" off, its alternative never run, is no decision: a run that uses the tune decides it as auto.
    monkeypatch.setenv(FAKE_CPU_ENV, "amx")  # a CPU whose bf16 is worth searching, as the space below has it
    space = [("precision", ["fp32", "bf16-mixed"]), ("compile", [False, True]), ("grad_accum", [1, 2])]
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    monkeypatch.setattr("redline.bench.tune._measure", interrupted_at("compile"))
    task = mlp_task()
    with pytest.raises(TuneInterrupted) as stopped:
        tune(task, devices="cpu", planned_steps=100)
    tuned = stopped.value.tuned
    assert stopped.value.exit_code == 130 and tuned.best == Candidate(precision="bf16-mixed")
    assert tuned.unmeasured == ("compile", "grad_accum")
    assert tuned.reasons["precision"].startswith("bf16-mixed, 2.00x less time")  # what was measured is not lost
    assert tuned.reasons["compile"].startswith(
        "not measured: the search was interrupted (SIGINT); left to the run's auto"
    )
    assert tuned.reasons["budget"].startswith("interrupted (SIGINT) after")
    assert "the axes measured before it were cached, and compile, grad_accum left to auto" in str(stopped.value)
    assert [plan["unmeasured"] for plan in cached_plans(tmp_path)] == [["compile", "grad_accum"]]
    found = find_tuned(task, RuntimeOptions(devices="cpu"), task.batch_size, DistEnv())
    assert found is not None and found.options.precision == "bf16-mixed"  # the measured axis is applied
    assert found.options.compile == "auto" and found.options.grad_accum == 1  # the others are the run's own
    assert "compile" not in found.tuning.reasons and "grad_accum" not in found.tuning.reasons
    with pytest.raises(TuneInterrupted):
        tune_command(task="example:digits", task_arg=None, devices="cpu", budget=60.0, planned_steps=100,
                     batch_size=None, steps=10, json_output=True)  # fmt: skip
    shown = json.loads(capsys.readouterr().out)
    assert shown["cached"] and shown["unmeasured"] == ["compile", "grad_accum"]
    assert [t["step_s"] for t in shown["trials"]] == [0.010, 0.005]  # the precision axis's timings


def test_the_model_is_not_built_again_once_the_search_has_ended(tmp_path, monkeypatch):
    """It was, twice, outside the search's Ctrl-C handling: a real factory takes seconds (GPT-2's about 2 s), and a
    Ctrl-C or a scheduler's SIGTERM landing in it lost every axis measured, with no table and nothing cached."""
    space = [("precision", ["fp32", "bf16-mixed"]), ("compile", [False, True])]
    searched = []

    def measure(task, device, candidates, planned, steps, window, seed, budget_s):
        searched.append(candidates)
        return [Trial(c, 0.010 if c.precision == "fp32" else 0.005) for c in candidates]

    def build():
        built.append(len(searched))  # how many axes were measured when it was called
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    built: list[int] = []
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    monkeypatch.setattr("redline.bench.tune._measure", measure)
    tuned, path = tune(dataclasses.replace(mlp_task(), model=build), devices="cpu", planned_steps=100)
    assert built and len(space) not in built, f"built after the search: {built}"
    assert tuned.best == Candidate(precision="bf16-mixed") and tuned.unmeasured == ()
    assert [plan["unmeasured"] for plan in cached_plans(tmp_path)] == [[]] and Path(path).exists()


@pytest.mark.parametrize("by, code", [(KeyboardInterrupt(), 130), (Terminated(signal.SIGTERM), 143)])
def test_a_signal_as_the_ended_search_is_cached_caches_all_of_it_and_exits_as_stopped(tmp_path, monkeypatch, by, code):
    space = [("precision", ["fp32", "bf16-mixed"]), ("compile", [False, True])]
    said = []

    def tell(done, total, what):
        said.append(what)
        if what == "done" and said.count("done") == 1:
            raise by  # the signal lands after the last axis, where the command line's bar is told the search ended

    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    monkeypatch.setattr("redline.bench.tune._measure", lambda task, device, candidates, *_: [
        Trial(c, 0.010 if c.precision == "fp32" else 0.005) for c in candidates
    ])  # fmt: skip
    with pytest.raises((TuneInterrupted, KeyboardInterrupt)) as stopped:  # a bare one would end the test session
        tune(mlp_task(), devices="cpu", planned_steps=100, progress=tell)
    assert isinstance(stopped.value, TuneInterrupted), "the signal lost the search"
    assert stopped.value.exit_code == code and stopped.value.tuned.unmeasured == ()
    assert str(stopped.value).startswith(f"tune interrupted by {signal.Signals(code - 128).name} after its search: "
                                         "its result was cached\nhint: --plan tuned runs it")  # fmt: skip
    assert stopped.value.tuned.best == Candidate(precision="bf16-mixed")
    assert stopped.value.tuned.reasons["budget"].startswith("searched in")  # the search was whole
    assert [plan["unmeasured"] for plan in cached_plans(tmp_path)] == [[]] and Path(stopped.value.path).exists()


def test_an_axis_the_budget_left_unmeasured_is_cached_as_left_to_auto(tmp_path, monkeypatch, capsys):
    def compile_unmeasured(task, device, candidates, planned, steps, window, seed, budget_s):
        return [Trial(c, 0.010) if not c.compile else Trial(c, None, rejected=UNMEASURED) for c in candidates]

    monkeypatch.setenv(FAKE_CPU_ENV, "amx")  # a CPU whose bf16 is worth searching, as the space below has it
    space = [("precision", ["fp32", "bf16-mixed"]), ("compile", [False, True])]
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    monkeypatch.setattr("redline.bench.tune._measure", compile_unmeasured)
    tuned, path = tune(mlp_task(), devices="cpu", planned_steps=100, budget_s=60)
    assert [plan["unmeasured"] for plan in cached_plans(tmp_path)] == [["compile"]] and path.endswith(".json")
    assert tuned.reasons["precision"].startswith("fp32 kept (fp32, eager: 10 ms/step")  # measured: a decision
    assert tuned.reasons["compile"].startswith("not measured in full: compile off kept (")
    assert "; left to the run's auto" in tuned.reasons["compile"] and tuned.unmeasured == ("compile",)
    applied = tuned.apply(RuntimeOptions())
    assert applied.precision == "fp32" and applied.compile == "auto"
    assert tuned.apply(RuntimeOptions(compile="on")).compile == "on"  # asked for: the user's, as ever
    tune_command(task="example:digits", task_arg=None, devices="cpu", budget=60.0, planned_steps=100,
                 batch_size=None, steps=10, json_output=False)  # fmt: skip
    shown = capsys.readouterr().out
    assert "chosen: fp32, eager; left to auto (not measured): compile" in shown and "use it" in shown


def test_a_tune_its_budget_cut_short_replaces_a_fuller_one_and_says_so(tmp_path, monkeypatch, caplog):
    """It replaced a tune that measured every axis without a word, and `--plan tuned` then left an axis to auto."""

    def every_axis(task, device, candidates, planned, steps, window, seed, budget_s):
        return [Trial(c, 0.010) for c in candidates]

    def compile_unmeasured(task, device, candidates, planned, steps, window, seed, budget_s):
        return [Trial(c, 0.010) if not c.compile else Trial(c, None, rejected=UNMEASURED) for c in candidates]

    space = [("precision", ["fp32"]), ("compile", [False, True])]
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    monkeypatch.setattr("redline.bench.tune._measure", every_axis)
    first, _ = tune(mlp_task(), devices="cpu", planned_steps=100, budget_s=60)
    assert first.unmeasured == () and not caplog.records
    monkeypatch.setattr("redline.bench.tune._measure", compile_unmeasured)
    with caplog.at_level("WARNING", logger="redline"):
        tune(mlp_task(), devices="cpu", planned_steps=100, budget_s=60)
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"this tune, cut short by its budget, left compile to auto: it replaces the tune of "
                           f"{first.measured_at}, which measured every axis, and --plan tuned now runs it")  # fmt: skip
    assert [plan["unmeasured"] for plan in cached_plans(tmp_path)] == [["compile"]], "asked for: it is cached"


def test_a_ctrl_c_before_the_first_axis_was_measured_caches_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "redline.bench.tune.search_space", lambda task, facts, **_: [("precision", ["fp32", "bf16-mixed"])]
    )
    monkeypatch.setattr("redline.bench.tune._measure", interrupted_at("precision"))
    with pytest.raises(StoppedBySignal, match="while it measured precision, its first axis: no Plan was cached") as e:
        tune(mlp_task(), devices="cpu")
    assert e.value.exit_code == 130 and not measured_entries(tmp_path / "cache")


def test_a_micro_batched_candidate_is_timed_per_whole_optimizer_step(monkeypatch):
    # A clock that only an optimizer step moves: a step costs 1 s whether the batch runs as one or as two
    # micro-batches, and a window cut between optimizer steps would charge the micro-batched one extra steps.
    now = [0.0]

    def counted_sgd(params):
        optimizer = torch.optim.SGD(params, lr=0.01)
        optimizer.register_step_post_hook(lambda *args: now.__setitem__(0, now[0] + 1.0))
        return optimizer

    monkeypatch.setattr("redline.bench.run.time_steps", functools.partial(time_steps, clock=lambda: now[0]))
    task = dataclasses.replace(mlp_task(), optimizer=counted_sgd)
    whole, split = _measure(task, "cpu", [Candidate(), Candidate(grad_accum=2)], 100, steps=15, window=5, seed=0,
                            budget_s=60.0)  # fmt: skip
    assert not whole.rejected and not split.rejected
    assert whole.step_s == pytest.approx(1.0) and split.step_s == pytest.approx(1.0)


@pytest.mark.parametrize(("graphs_ms", "chosen"), [(4.0, ("reduce-overhead", True)), (12.0, ("default", False))])
def test_cuda_graphs_are_tried_against_eager_where_the_default_compile_lost(monkeypatch, graphs_ms, chosen):
    # As on a GPU for a model bound by kernel launches: the default compile is slower than eager, CUDA graphs
    # (reduce-overhead) may still be faster, since they cut the launches; they win only if they are.
    measured = []

    def fake_measure(task, device, candidates, planned, steps, window, seed, budget_s):
        measured.append(candidates)
        ms = {(False, "default"): 10.0, (True, "default"): 20.0, (True, "reduce-overhead"): graphs_ms}
        return [Trial(c, ms[c.compile, c.compile_mode] / 1e3, compile_s=5.0 if c.compile else 0.0) for c in candidates]

    space = [("compile", [False, True]), ("compile_mode", ["default", "reduce-overhead"])]
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    monkeypatch.setattr("redline.bench.tune.skipped_axes", lambda task, facts, **_: {})
    monkeypatch.setattr("redline.bench.tune._measure", fake_measure)
    tuned, _ = tune(mlp_task(), devices="cpu", planned_steps=10_000)
    assert measured[1] == [Candidate(), Candidate(compile=True, compile_mode="reduce-overhead")]
    assert (tuned.best.compile_mode, tuned.best.compile) == chosen
    shown = "compile on in mode reduce-overhead, 2.22x less time" if chosen[1] else "compile off kept"
    assert tuned.reasons["compile"].startswith(shown)


def test_a_compile_that_fell_back_to_eager_is_not_tuned_as_compiled(broken_compiler, monkeypatch):
    # torch.compile fails here (a broken backend, as a broken compiler would) and the Runtime runs eagerly: the
    # compiled candidate would time the eager model and could win by noise, leaving a tuned Plan that claims
    # compile is on and faster. Any alternative wins here, as noise could make one.
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: [("compile", [False, True])])
    monkeypatch.setattr("redline.bench.tune.MARGIN", 1e-9)
    tuned, _ = tune(mlp_task(), devices="cpu", budget_s=60, planned_steps=100, steps=4, window=2)
    assert tuned.best.compile is False
    compiled = next(t for t in tuned.trials if t.candidate.compile)
    assert compiled.step_s is None and compiled.rejected.startswith("torch.compile fell back to eager")
    assert "backend exploded" in compiled.rejected
    shown = tuned.reasons["compile"]  # what the tune's table prints
    assert shown.startswith("compile off kept") and "compiled (default): rejected, torch.compile fell back" in shown


@pytest.mark.parametrize("fails", [True, False])
def test_a_graphs_candidate_that_never_replayed_is_rejected_not_timed_as_graphs(monkeypatch, fails):
    # Graphs proposed as on a CUDA device, and each capture fails: the Runtime runs the model's own forward, so the
    # graphs candidate would time the eager model and could win by noise, leaving a tuned Plan with graphs on.
    # One whose graphs replayed is timed.
    capture = Capture(fail=RuntimeError("capture exploded") if fails else None)
    monkeypatch.setattr(graphs_home, "resolve_graphs", lambda requested, facts, **_: Choice(requested != "off", "x"))
    monkeypatch.setattr(runtime_home, "check_cuda_graphs", lambda requested, device_type: None)
    monkeypatch.setattr(graphs_home, "GraphRecord", functools.partial(graphs_home.GraphRecord, capture=capture))
    eager, graphs = _measure(mlp_task(), "cpu", [Candidate(), Candidate(cuda_graphs=True)], 100, steps=4, window=2,
                             seed=0, budget_s=60.0)  # fmt: skip
    assert capture.samples  # a capture was tried
    assert not eager.rejected and eager.step_s is not None
    if not fails:
        assert not graphs.rejected and graphs.step_s is not None and capture.replays > 0
        return
    assert graphs.step_s is None and graphs.rejected.startswith("the CUDA graphs never replayed, so it would time the")
    assert "capture exploded" in graphs.rejected


def test_a_tune_at_another_batch_size_is_found_by_train_at_that_batch_size(tmp_path, monkeypatch, capsys):
    # `redline tune --batch-size 16` then `redline train --batch-size 16 --plan tuned`: the train keeps the
    # task's own batch_size and passes 16 beside it, so the tune must cache under the same key.
    spec = tmp_path / "mlp.py"
    spec.write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\nfrom redline import Task\n"
        "def mlp():\n    x, y = torch.randn(128, 8), torch.randint(0, 3, (128,))\n"
        "    return Task(model=lambda: nn.Sequential(nn.Linear(8, 3)), loss_fn=nn.functional.cross_entropy,\n"
        "                train_data=TensorDataset(x, y), batch_size=32, name='mlp')\n"
    )

    def fake_measure(task, device, candidates, planned, steps, window, seed, budget_s):
        return [Trial(c, 0.010 if c.grad_accum == 1 else 0.005) for c in candidates]

    monkeypatch.setattr("redline.bench.tune._measure", fake_measure)
    tune_command(task=f"{spec}:mlp", task_arg=None, devices="cpu", budget=60.0, planned_steps=100, batch_size=16,
                 steps=4, json_output=True)  # fmt: skip
    tune_command(task=f"{spec}:mlp", task_arg=None, devices="cpu", budget=60.0, planned_steps=100, batch_size=16,
                 steps=4, json_output=False)  # fmt: skip
    shown = capsys.readouterr().out
    assert f"use it: redline train --task {spec}:mlp --batch-size 16 --devices cpu --max-steps 100 --plan tuned\n" in (
        shown
    )  # the run weighed: --planned-steps 100
    tune_command(task=f"{spec}:mlp", task_arg=None, devices="cpu", budget=60.0, planned_steps=None, batch_size=16,
                 steps=4, json_output=False)  # fmt: skip
    shown = capsys.readouterr().out  # the run weighed: the task's epochs, which train runs without --max-steps
    assert f"use it: redline train --task {spec}:mlp --batch-size 16 --devices cpu --plan tuned\n" in shown
    config = TrainerConfig(max_steps=1, plan="tuned", batch_size=16, progress=False)
    summary = Trainer(load_task(f"{spec}:mlp"), config).fit()
    assert summary.plan.grad_accum.value == 2 and "tuned" in summary.plan.grad_accum.reason


def test_tune_says_before_it_searches_that_its_steps_round_up_to_whole_windows(monkeypatch, capsys):
    timed = []

    def fake_measure(task, device, candidates, planned, steps, window, seed, budget_s):
        timed.append((steps, window))
        return [Trial(c, 0.010) for c in candidates]

    monkeypatch.setattr("redline.bench.tune._measure", fake_measure)
    tune_command(task="example:digits", task_arg=None, devices="cpu", budget=60.0, planned_steps=100, batch_size=None,
                 steps=12, json_output=True)  # fmt: skip
    assert "note: --steps 12 times 15 steps per candidate: whole windows of 5, two at least" in capsys.readouterr().err
    tune_command(task="example:digits", task_arg=None, devices="cpu", budget=60.0, planned_steps=100, batch_size=None,
                 steps=10, json_output=True)  # fmt: skip
    assert "note:" not in capsys.readouterr().err and timed[-1] == (10, 5)


@pytest.mark.slow
def test_every_compiled_candidate_is_charged_the_compile_a_fresh_run_pays():
    # torch.compile's cache is process-wide: a second model of the same structure compiles in no time.
    # A candidate must not look cheaper because an earlier one (another axis, or a loader setting that
    # leaves the model as it is) compiled its graph first.
    task = mlp_task()
    compiled = Candidate(compile=True)
    first = _measure(task, "cpu", [Candidate(), compiled], 100, steps=4, window=2, seed=0, budget_s=30.0)
    again = _measure(task, "cpu", [compiled, Candidate(compile=True, loader_workers=0)], 100, steps=4, window=2,
                     seed=0, budget_s=30.0)  # fmt: skip
    assert first[1].compile_s > 0
    assert again[0].compile_s > 0 and again[1].compile_s == again[0].compile_s


def test_a_graph_an_earlier_axis_compiled_is_charged_its_first_compile_not_its_warm_load(monkeypatch):
    # Each axis clears torch.compile's in-process cache, but the best's graph sits in inductor's on-disk cache from an
    # earlier axis: it was charged a warm 0.4 s where a new compiled alternative paid a cold 5.6 s, and lost to it.
    compiled_before = set()

    def measure(task, device, candidates, planned, steps, window, seed, budget_s):
        trials = []
        for candidate in candidates:
            warm = candidate in compiled_before  # served from the on-disk caches
            compiled_before.add(candidate)
            compile_s = (0.4 if warm else 5.6) if candidate.compile else 0.0
            step_s = 0.008 if candidate.grad_accum == 2 else 0.010 if candidate.compile else 0.020
            trials.append(Trial(candidate, step_s, compile_s, compile_cached=warm))
        return trials

    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: [
        ("compile", [False, True]), ("grad_accum", [1, 2])
    ])  # fmt: skip
    monkeypatch.setattr("redline.bench.tune._measure", measure)
    tuned, _ = tune(mlp_task(), devices="cpu", planned_steps=1000, budget_s=60)
    assert tuned.best == Candidate(compile=True, grad_accum=2)  # 5.6 + 8 s against 5.6 + 10 s: not 0.4 + 10 s
    current = "fp32, compiled (default): 10 ms/step + 5.6 s compile (as first compiled in this tune) = 15.6 s"
    assert current in tuned.reasons["grad_accum"]
    assert TunedPlan.from_dict(json.loads(json.dumps(tuned.to_dict()))) == tuned  # the mark is cached, and read back


def test_an_explicit_flag_that_overrides_the_tune_keeps_its_own_reason():
    task = mlp_task()
    tuned = TunedPlan(
        task=task.name, device="cpu", batch_size=task.batch_size, planned_steps=500,
        measured_at="2026-12-01 06:00 UTC", best=Candidate(precision="bf16-mixed"),
        reasons={"precision": "bf16-mixed, 1.40x less time for 500 steps (made up)", "compile": "compile off kept"},
        trials=(Trial(Candidate(), 0.002),),
    )  # fmt: skip
    store_tuned(task.fingerprint(), probe_device(torch.device("cpu")), tuned, model=task.build_model())
    config = TrainerConfig(max_steps=1, plan="tuned", progress=False, runtime=RuntimeOptions(precision="fp32"))
    plan = Trainer(task, config).fit().plan
    assert plan.precision.value == "fp32" and "bf16-mixed" not in plan.precision.reason  # the flag won, and says so
    assert plan.compile.value is False and plan.compile.reason.startswith("tuned")
    with Runtime(devices="cpu", plan="tuned", precision="fp32") as rt:
        rt.setup(task.build_model(), task.optimizer)
        assert rt.explain().precision.value == "fp32" and "bf16-mixed" not in rt.explain().precision.reason


def complete_tune(monkeypatch) -> tuple[TunedPlan, str]:
    """A tune of three axes, each measured in full (bf16-mixed at half fp32's step), cached; and where."""
    monkeypatch.setenv(FAKE_CPU_ENV, "amx")
    space = [("precision", ["fp32", "bf16-mixed"]), ("compile", [False, True]), ("grad_accum", [1, 2])]
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    monkeypatch.setattr(
        "redline.bench.tune._measure",
        lambda task, device, candidates, *args: [
            Trial(c, 0.010 if c.precision == "fp32" else 0.005) for c in candidates
        ],
    )
    return tune(mlp_task(), devices="cpu", planned_steps=100)


@pytest.mark.usefixtures("compiles_tried")
def test_a_stopped_search_keeps_an_earlier_tune_that_measured_more(tmp_path, monkeypatch, capsys):
    # A re-tune stopped by Ctrl-C replaced a complete tune with its partial one: three measured axes lost.
    complete, path = complete_tune(monkeypatch)
    assert complete.unmeasured == () and [plan["unmeasured"] for plan in cached_plans(tmp_path)] == [[]]
    before = Path(path).read_text()
    monkeypatch.setattr("redline.bench.tune._measure", interrupted_at("compile"))
    with pytest.raises(TuneInterrupted) as stopped:
        tune(mlp_task(), devices="cpu", planned_steps=100)
    assert stopped.value.path == path and stopped.value.kept == complete
    assert f"no Plan was cached: the earlier tune of {complete.measured_at}, which measured every axis, is kept" in (
        str(stopped.value)
    )
    assert Path(path).read_text() == before
    monkeypatch.setattr("redline.cli.tune.tune", lambda *args, **kwargs: (_ for _ in ()).throw(stopped.value))
    with pytest.raises(TuneInterrupted):
        tune_command(task="example:digits", task_arg=None, devices="cpu", budget=60.0, planned_steps=100,
                     batch_size=None, steps=10, json_output=False)  # fmt: skip
    shown = " ".join(capsys.readouterr().out.split())
    assert f"cached: nothing new: the earlier tune above, which measured more, stays at {path}" in shown
    assert "left to auto" not in shown  # the table is the earlier tune's, which --plan tuned runs
    monkeypatch.setattr("redline.bench.tune._measure", interrupted_at("compile"))
    with pytest.raises(TuneInterrupted) as longer:  # a tune for another run length decides compile for that length
        tune(mlp_task(), devices="cpu", planned_steps=100_000)
    assert longer.value.kept is None and [plan["planned_steps"] for plan in cached_plans(tmp_path)] == [100_000]


@pytest.mark.usefixtures("compiles_tried")
def test_a_stopped_search_keeps_a_complete_tune_an_earlier_version_made_before_axes_it_cannot_search_here(
    tmp_path, monkeypatch
):
    # A tune cached before the CUDA graphs and attention axes existed reads them as unmeasured; a CPU search skips
    # both, so they weighed against the earlier tune, and a Ctrl-C'd partial tune replaced it.
    complete, path = complete_tune(monkeypatch)
    assert complete.unmeasured == ()
    entry = json.loads(Path(path).read_text())
    for candidate in (entry["best"], *(trial["candidate"] for trial in entry["trials"])):
        candidate.pop("cuda_graphs", None)
        candidate.pop("attention", None)
    Path(path).write_text(json.dumps(entry))
    before = Path(path).read_text()
    monkeypatch.setattr("redline.bench.tune._measure", interrupted_at("compile"))
    with pytest.raises(TuneInterrupted) as stopped:
        tune(mlp_task(), devices="cpu", planned_steps=100)
    assert stopped.value.kept is not None and Path(path).read_text() == before


def test_a_budget_that_decides_no_axis_is_refused_and_caches_nothing(tmp_path, monkeypatch):
    # It cached a Plan that left every axis to auto, said what it "chose", and offered --plan tuned.
    space = [("precision", ["fp32", "bf16-mixed"]), ("compile", [False, True])]
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: space)
    monkeypatch.setattr(
        "redline.bench.tune._measure",
        lambda task, device, candidates, *args: (
            [Trial(candidates[0], 0.010)] + [Trial(c, None, rejected=UNMEASURED) for c in candidates[1:]]
        ),
    )
    with pytest.raises(ConfigError, match=r"budget_s=.* is not allowed; expected enough seconds to measure one axis"):
        tune(mlp_task(), devices="cpu", planned_steps=100, budget_s=60)
    assert cached_plans(tmp_path) == []


CHATTY_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline

def make():
    print("loading 64 samples")
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    return redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8, name="chatty")
"""


def test_tune_json_holds_the_json_alone_when_the_task_file_prints(tmp_path, monkeypatch, redline_here):
    """Before, the factory's print came first on stdout: `tune --json | jq` read no JSON."""
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: [("grad_accum", [1, 2])])
    monkeypatch.setattr(
        "redline.bench.tune._measure", lambda task, device, candidates, *args: [Trial(c, 0.01) for c in candidates]
    )
    (tmp_path / "chatty.py").write_text(CHATTY_TASK)
    result = redline_here("tune", "--task", f"{tmp_path / 'chatty.py'}:make", "--devices", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["task"] == "chatty"
    assert "loading 64 samples\n" in result.stderr


STREAM_TASK = """
import torch
from torch import nn
from torch.utils.data import IterableDataset
from redline import Task

class Stream(IterableDataset):
    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for _ in range(10_000):
            yield torch.randn(8, generator=generator), torch.randint(0, 3, (), generator=generator)

def stream():
    return Task(model=lambda: nn.Linear(8, 3), loss_fn=nn.functional.cross_entropy, train_data=Stream(),
                batch_size=8, name="stream")
"""


def test_the_command_tune_prints_for_a_stream_runs_the_steps_it_weighed(tmp_path, monkeypatch, capsys):
    # `use it: redline train --task ... --plan tuned` failed for a stream: "train_data is a stream ... pass --max-steps"
    from typer.testing import CliRunner

    from redline.cli.main import app

    (tmp_path / "tasks.py").write_text(STREAM_TASK)
    spec = f"{tmp_path / 'tasks.py'}:stream"
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: [("grad_accum", [1, 2])])
    monkeypatch.setattr("redline.bench.tune._measure", lambda task, device, candidates, *_: [
        Trial(c, 0.010 / c.grad_accum) for c in candidates
    ])  # fmt: skip
    common = dict(task_arg=None, devices="cpu", budget=60.0, batch_size=None, steps=10, json_output=False)
    tune_command(task=spec, planned_steps=None, **common)
    said = capsys.readouterr()
    assert "note: train_data is a stream without a length: the search weighs a run of 1000 steps" in said.err
    use = f"use it: redline train --task {spec} --devices cpu --max-steps 1000 --plan tuned"
    assert said.out.rstrip().endswith(use)
    tune_command(task=spec, planned_steps=6, **common)
    said = capsys.readouterr()
    assert "note: train_data is a stream" not in said.err
    use = said.out.rstrip().rsplit("use it: redline ", 1)[1]
    assert use.endswith("--max-steps 6 --plan tuned")
    result = CliRunner().invoke(app, [*shlex.split(use), "--no-progress", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 6 and summary["plan"]["grad_accum"]["value"] == 2


def test_a_tune_searched_on_a_busy_machine_says_so_and_plain_auto_leaves_it(monkeypatch, caplog):
    # A tune measured beside other work kept a loser (bf16 at 0.62x the naive loop on the quiet machine), and plain
    # auto took it without a word
    busy = "other processes kept 1.0 of the 2 CPU(s) it may run on busy"
    monkeypatch.setattr("redline.bench.tune.search_space", lambda task, facts, **_: [("compile", [False, True])])
    monkeypatch.setattr(
        "redline.bench.tune._measure", lambda task, device, candidates, *a: [Trial(c, 0.01) for c in candidates]
    )
    monkeypatch.setattr("redline.bench.tune._busy", lambda sampler: busy)
    task = mlp_task()
    tuned, _ = tune(task, devices="cpu", budget_s=60)
    assert tuned.busy == busy and TunedPlan.from_dict(tuned.to_dict()).busy == busy
    assert tuned.reasons["budget"].endswith(f"; searched while {busy}: plain auto does not take it (--plan tuned "
                                            "does); tune again on a quiet machine")  # fmt: skip
    config = TrainerConfig(max_steps=2, progress=False)
    with caplog.at_level(logging.INFO, logger="redline"):
        assert use_tuned(task, config.runtime, task.batch_size, DistEnv(), config=config) is None
    assert (
        "steps, while other processes kept 1.0 of the 2 CPU(s) it may run on busy): plain auto does not "
        "take it (--plan tuned does)" in caplog.text
    )
    asked = dataclasses.replace(config, plan="tuned")
    found = use_tuned(task, asked.runtime, task.batch_size, DistEnv(), config=asked)
    assert found is not None and "while other processes kept 1.0 of the 2 CPU(s)" in found.tuning.note
