"""find_batch_size on a model that runs out of memory above a batch size: the sizes tried, the answer, the
clean-up between probes, and two ranks that agree."""

import dataclasses
import functools
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from batch_search_job import Limited, limited_task
from torch import nn
from torch.utils.data import IterableDataset

import redline
from redline.errors import ConfigError, StoppedBySignal, TrainingError

CPU = redline.RuntimeOptions(devices="cpu", precision="fp32")  # given: auto's trial is tested on its own, below
JOB = str(Path(__file__).with_name("batch_search_job.py"))


def sizes(search: redline.BatchSearch) -> list[tuple[int, bool]]:
    return [(size, fitted) for size, fitted, _ in search.tried]


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_doubles_then_bisects_to_the_largest_batch_that_trains(where):
    search = redline.find_batch_size(limited_task(21, where), options=CPU, max_batch_size=64)
    assert [s for s, _ in sizes(search)] == [1, 2, 4, 8, 16, 32, 24, 20, 22, 21]
    assert [ok for _, ok in sizes(search)] == [True] * 5 + [False, False, True, False, True]
    assert search.largest == 21 and search.cap == 64 and search.device == "cpu"
    assert search.precision == "fp32" and search.steps == 2 and search.world_size == 1
    errors = {size: error for size, _, error in search.tried}
    assert errors[22] == f"OutOfMemoryError: CUDA out of memory. Tried to allocate 22 rows ({where})"
    assert search.reason.startswith("21 fits; 22 ran out of memory (OutOfMemoryError: CUDA out of memory.")
    assert any(note.startswith("compile off") for note in search.notes)


def test_each_probe_trains_a_fresh_model_and_frees_the_last_one_first():
    task, seen, steps = limited_task(5), [], []
    last = {"model": None}

    def build() -> nn.Module:
        seen.append(all(ref() is None for ref in last.values() if ref is not None))
        model = Limited(5, "forward")
        model.register_forward_hook(lambda module, args, out: steps.append(args[0].shape[0]))
        last["model"] = weakref.ref(model)
        return model

    task = redline.Task(model=build, loss_fn=task.loss_fn, train_data=task.train_data)
    search = redline.find_batch_size(task, options=CPU, start=4, max_batch_size=16, steps=3)
    assert [s for s, _ in sizes(search)] == [4, 8, 6, 5]
    assert seen == [True] * 4  # every earlier probe's model (and its optimizer state) was gone before the next
    assert steps == [4, 4, 4, 5, 5, 5]  # three full steps on the sizes that fit; no forward gets past the limit


def test_a_compile_mode_in_the_runs_options_does_not_stop_the_search_which_runs_eager():
    # the search forced compile off and kept the mode, which RuntimeOptions then refused
    options = dataclasses.replace(CPU, compile="on", compile_mode="max-autotune")
    search = redline.find_batch_size(limited_task(1000, samples=16), options=options, start=8, max_batch_size=16)
    assert search.largest == 16


def test_on_a_cpu_the_cap_defaults_to_the_dataset_and_small_data_repeats():
    search = redline.find_batch_size(limited_task(1000, samples=48), options=CPU)
    assert [s for s, _ in sizes(search)] == [1, 2, 4, 8, 16, 32, 48] and search.largest == 48
    assert search.reason == "48 fits: the dataset's size (48), the largest batch a run has, stopped the search"
    assert any("dataset's size (48)" in note for note in search.notes)
    repeated = redline.find_batch_size(limited_task(1000, samples=10), options=CPU, start=8, max_batch_size=16)
    assert repeated.largest == 16 and any("gave 10 samples" in note for note in repeated.notes)
    assert repeated.reason == "16 fits: the cap (max_batch_size=16) stopped the search"


def test_nothing_fits_and_a_too_large_start_halves():
    none = redline.find_batch_size(limited_task(0), options=CPU, start=4, max_batch_size=64)
    assert sizes(none) == [(4, False), (2, False), (1, False)] and none.largest is None
    assert none.reason.startswith("nothing fits: batch size 1 ran out of memory")
    assert redline.find_batch_size(limited_task(5), options=CPU, start=64, max_batch_size=64).largest == 5


def test_an_error_that_is_not_out_of_memory_stops_the_search_naming_the_size():
    def loss_fn(out, y):
        if out.shape[0] > 4:
            raise ValueError("a bug in the loss")
        return nn.functional.cross_entropy(out, y)

    task = redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=loss_fn, train_data=limited_task(1).train_data)
    with pytest.raises(TrainingError, match=r"batch size 8, step 1: the model or loss raised ValueError: a bug"):
        redline.find_batch_size(task, options=CPU, max_batch_size=64)


def test_bad_arguments_are_refused():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from limited_task(1).train_data

    with pytest.raises(ConfigError, match="needs max_batch_size"):
        redline.find_batch_size(dataclasses.replace(limited_task(1), train_data=Stream()), options=CPU)
    with pytest.raises(ConfigError, match=r"start=200 is not allowed; expected at most 100"):
        redline.find_batch_size(limited_task(1), options=CPU, start=200)
    with pytest.raises(ConfigError, match="steps=0"):
        redline.find_batch_size(limited_task(1), options=CPU, steps=0)


def launch_job(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "redline", "launch", "--nproc", "2", JOB, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def test_two_ranks_with_different_limits_agree_on_the_smaller():
    result = launch_job("12", "9")
    assert result.returncode == 0, result.stderr[-3000:]
    searches = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(s["rank"] for s in searches) == [0, 1]
    first, second = searches
    assert first["largest"] == second["largest"] == 9  # rank 0 alone would have trained 12
    assert first["tried"] == second["tried"]
    assert [(t["batch_size"], t["fitted"]) for t in first["tried"]] == [
        (1, True), (2, True), (4, True), (8, True), (16, False), (12, False), (10, False), (9, True)
    ]  # fmt: skip
    assert first["tried"][5]["error"].startswith("rank 1: OutOfMemoryError")  # 12: rank 1's, told to rank 0
    assert first["world_size"] == 2 and any(note.startswith("per process") for note in first["notes"])


def test_a_bug_on_one_rank_stops_every_rank_instead_of_leaving_one_waiting():
    result = launch_job("12", "9", "--bug-on-rank-1")  # a hang would time out
    assert result.returncode != 0 and "{" not in result.stdout
    assert "batch size 8, step 1: the model or loss raised ValueError: a bug in rank 1's loss" in result.stderr
    assert "batch size 8: rank 1 failed: ValueError: a bug in rank 1's loss" in result.stderr  # rank 0's own


def test_a_rank_out_of_memory_building_its_model_leaves_none_waiting_in_ddp_s_constructor():
    result = launch_job("12", "9", "--oom-building-on-rank-1")  # a hang would time out
    assert result.returncode == 0, result.stderr[-3000:]
    searches = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [s["largest"] for s in searches] == [None, None]
    assert searches[0]["tried"] == searches[1]["tried"]
    assert [(t["batch_size"], t["fitted"]) for t in searches[0]["tried"]] == [(1, False)]
    assert searches[0]["tried"][0]["error"].startswith("rank 1: OutOfMemoryError")


def test_the_public_names():
    assert redline.find_batch_size.__module__ == "redline.memory.search"
    assert {"find_batch_size", "BatchSearch"} <= set(redline.__all__)


@pytest.fixture
def memory_cli(redline_here):
    """`redline memory` on the task that runs out of memory above its limit, in this process."""
    return functools.partial(redline_here, "memory", "--task", f"{JOB}:limited_task")


def test_redline_memory_measure_runs_the_search_on_this_machine(memory_cli):
    done = memory_cli("--task-arg", "limit=5", "--measure", "--max-batch-size", "16", "--json")
    assert done.returncode == 0, done.stderr
    search = json.loads(done.stdout)
    assert [t["batch_size"] for t in search["tried"]] == [1, 2, 4, 8, 6, 5]
    assert search["largest"] == 5 and search["cap"] == 16 and search["device"] == "cpu"
    table = memory_cli("--task-arg", "limit=5", "--measure", "--max-batch-size", "8", "--start", "4")
    assert table.returncode == 0, table.stderr
    assert "Batch-size search on cpu" in table.stdout and "largest batch: 5 fits" in table.stdout


def test_redline_memory_measure_refuses_another_gpu(memory_cli):
    done = memory_cli("--measure", "--gpu", "l4")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--measure runs on this machine's own device" in done.stderr


def test_the_search_leaves_the_caller_s_random_streams_as_they_were():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    seeded = redline.RuntimeOptions(devices="cpu", seed=0)
    assert redline.find_batch_size(limited_task(5), options=seeded, max_batch_size=8).largest == 5
    assert torch.equal(torch.rand(3), expected)  # each probe's model drew its weights, and the seed reseeded


def test_the_search_trains_under_the_caller_s_no_grad_and_leaves_it_in_place():
    with torch.no_grad():  # a training step needs autograd: the search turns it on for its probes only
        assert redline.find_batch_size(limited_task(5), options=CPU, max_batch_size=8).largest == 5
        assert not torch.is_grad_enabled()


def test_redline_memory_measure_refuses_a_batch_size_it_would_ignore(memory_cli):
    done = memory_cli("--task-arg", "limit=5", "--measure", "--max-batch-size", "8", "--batch-size", "64")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--batch-size" in done.stderr and "--start" in done.stderr


def test_redline_memory_measure_says_its_cap_by_the_flag_the_user_typed() -> None:
    from typer.testing import CliRunner

    from redline.cli.main import app

    args = ["memory", "--task", "example:digits", "--measure", "--start", "8", "--max-batch-size", "16", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    search = json.loads(result.stdout[result.stdout.index("{") :])
    assert search["reason"] == "16 fits: the cap (--max-batch-size 16) stopped the search"
    assert "max_batch_size" not in json.dumps([search["reason"], search["notes"]])


def test_on_a_cpu_a_stream_that_states_its_length_caps_the_search_as_a_dataset_does():
    class Stream(IterableDataset):
        def __len__(self):
            return 12

        def __iter__(self):
            yield from limited_task(1, samples=12).train_data

    search = redline.find_batch_size(dataclasses.replace(limited_task(1000), train_data=Stream()), options=CPU)
    assert [s for s, _ in sizes(search)] == [1, 2, 4, 8, 12] and search.largest == 12 and search.cap == 12
    assert search.reason == "12 fits: the dataset's size (12), the largest batch a run has, stopped the search"


class Normed(Limited):
    """The limited MLP with a BatchNorm1d, which refuses a batch of one sample in training."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit, "forward")
        self.rest = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_a_model_that_cannot_train_on_one_sample_is_searched_from_two():
    task = dataclasses.replace(limited_task(5), model=lambda: Normed(5))
    search = redline.find_batch_size(task, options=CPU, max_batch_size=64)
    assert [s for s, _ in sizes(search)] == [2, 4, 8, 6, 5] and search.largest == 5
    assert (
        "batch size 1 cannot train (ValueError: Expected more than 1 value per channel when training"
        in search.notes[-1]
    )
    none = redline.find_batch_size(dataclasses.replace(task, model=lambda: Normed(1)), options=CPU, max_batch_size=64)
    assert sizes(none) == [(2, False)] and none.largest is None  # 1 is not tried again: it cannot train
    assert none.reason.startswith("nothing fits: batch size 2 ran out of memory")
    # halved down to 1 from a larger start: it aborted there, on BatchNorm's refusal, instead of saying nothing fits
    halved = redline.find_batch_size(dataclasses.replace(task, model=lambda: Normed(1)), options=CPU, start=4)
    assert sizes(halved) == [(4, False), (2, False)] and halved.largest is None
    assert halved.reason.startswith("nothing fits: batch size 2 ran out of memory")
    assert "Expected more than 1 value per channel" in halved.notes[-1] and "stopped at 2" in halved.notes[-1]
    one = r"batch size 1, step 1: the model raised ValueError: Expected(?s:.*)hint: a batch norm .* batches of 2"
    with pytest.raises(TrainingError, match=one):
        redline.find_batch_size(task, options=CPU, start=1, max_batch_size=1)  # 1 is all there is to try


class NormedReadingAValue(Normed):
    """Normed whose constructor reads a tensor's value (timm's stochastic depth), which the meta device refuses."""

    def __init__(self, limit: int) -> None:
        super().__init__(int(torch.tensor(limit).item()))


def test_a_model_that_reads_a_value_as_it_builds_and_cannot_train_on_one_sample_is_searched_from_two():
    # its BatchNorm went unseen (the meta build failed), and the search raised BatchNorm's refusal of one sample
    task = dataclasses.replace(limited_task(5), model=lambda: NormedReadingAValue(5))
    search = redline.find_batch_size(task, options=CPU, start=1, max_batch_size=64)
    assert search.largest == 5 and "batch size 1 cannot train" in search.notes[-1]


def test_on_a_cpu_a_size_predicted_past_the_process_s_memory_is_not_run(monkeypatch):
    # a CPU has no out-of-memory error: past its memory the kernel kills the process, and the search with it
    import redline.memory.host as host

    ran: list[int] = []

    class Peak:  # the process's peak over a probe: 100 MiB of its own, and 1 MiB a sample
        def __init__(self, device):
            pass

        def read(self):
            return (100 + ran[-1]) * 2**20 if ran else None

    def build() -> nn.Module:
        model = Limited(1000, "forward")
        model.register_forward_pre_hook(lambda module, args: ran.append(args[0].shape[0]))
        return model

    monkeypatch.setattr(host, "WindowPeak", Peak)
    monkeypatch.setattr(host, "host_budget", lambda: 150 * 2**20)  # room for 50 samples
    task = dataclasses.replace(limited_task(1000), model=build)
    search = redline.find_batch_size(task, options=CPU, max_batch_size=100)
    assert search.largest == 50 and max(ran) == 50  # no size past the budget ran
    assert [s for s, _ in sizes(search)] == [1, 2, 4, 8, 16, 32, 64, 48, 56, 52, 50, 51]
    refused = dict((s, error) for s, ok, error in search.tried if not ok)
    assert set(refused) == {64, 56, 52, 51}
    assert refused[51] == (
        "was not run: predicted to need about 0.147 GiB (from the peaks of the sizes that ran), past the 0.146 GiB "
        "this machine gives the process, where the kernel would kill it"  # as many digits as tell the two apart
    )
    assert search.reason == f"50 fits; 51 {refused[51]}"


@pytest.mark.parametrize(("limit", "expected"), [(1000, [1, 2, 4, 8, 16]), (10, [1, 2, 4, 8, 16, 12, 10, 11])])
def test_a_stream_of_no_length_caps_the_search_where_it_ends(monkeypatch, limit, expected):
    # a GPU searches a stream with no cap, its out-of-memory ends the doubling: sizes past the stream's end repeated
    # its items, up to a size no run has (and a long wait, collating millions of items for a small model)
    import redline.memory.search as search_module

    class Stream(IterableDataset):
        def __iter__(self):
            yield from limited_task(1, samples=12).train_data

    monkeypatch.setattr(search_module, "_cap", lambda data, device, max_batch_size: (None, []))  # as on a GPU
    task = dataclasses.replace(limited_task(limit), train_data=Stream())
    search = redline.find_batch_size(task, options=CPU)
    assert [s for s, _ in sizes(search)] == expected and search.largest == min(limit, 12) and search.cap == 12
    assert "train_data is a stream that ended after 12 items: no run has a larger batch" in search.notes[-1]
    if limit > 12:
        assert search.reason == "12 fits: the dataset's size (12), the largest batch a run has, stopped the search"
    else:
        assert search.reason.startswith("10 fits; 11 ran out of memory")


def test_an_auto_search_runs_in_the_precision_a_trial_measured_as_redline_train_does(bf16_measured_faster):
    autocast: list[bool] = []

    def build() -> nn.Module:
        model = Limited(5, "forward")
        model.register_forward_pre_hook(  # the training forwards (the trial's look at the model's calls runs no_grad)
            lambda module, args: autocast.append(torch.is_autocast_enabled("cpu")) if torch.is_grad_enabled() else None
        )
        return model

    task, auto = dataclasses.replace(limited_task(5), model=build), redline.RuntimeOptions(devices="cpu")
    search = redline.find_batch_size(task, options=auto, max_batch_size=8)
    assert search.largest == 5 and search.precision == "bf16-mixed"  # the rule keeps fp32 on a CPU
    assert search.precision_reason.startswith("measured: bf16-mixed ran 1.43x fp32")
    assert autocast and all(autocast)  # every probe stepped in bf16 (the faked trial runs no forward)
    again = redline.find_batch_size(task, options=auto, max_batch_size=8)
    assert again.precision == "bf16-mixed" and "cached from" in again.precision_reason
    assert bf16_measured_faster == [["bf16-mixed"]]  # measured once, at the cap (the task's batch is 64)


def test_an_auto_search_runs_no_trial_past_its_cap_but_takes_one_cached_at_the_batch(bf16_measured_faster, monkeypatch):
    """Before, the trial ran at the task's batch (4096, say) past --max-batch-size: a CPU's out-of-memory killed the
    process before any guarded size ran."""
    from redline.parallel.env import read_env
    from redline.runtime import measure

    batches, fake = [], measure.run_trial

    def trial(model, optimizer, loss_fn, batch, *args, **kwargs):
        batches.append(batch[0].shape[0])
        return fake(model, optimizer, loss_fn, batch, *args, **kwargs)

    monkeypatch.setattr(measure, "run_trial", trial)
    task, auto = limited_task(100), redline.RuntimeOptions(devices="cpu")
    search = redline.find_batch_size(task, options=auto, max_batch_size=4)
    assert batches == [4] and task.batch_size == 64 and search.precision == "bf16-mixed"
    assert search.notes[-1] == (
        "the precision trial ran at batch 4, the search's cap, not at the run's 64, which the cap keeps from running "
        "here; `redline train` measures at 64 and may choose otherwise"
    )
    measure.measure_auto(task, auto, 64, 1, read_env(), trial="on")  # as `redline train` does
    again = redline.find_batch_size(task, options=auto, max_batch_size=2)
    assert batches == [4, 64] and "cached from" in again.precision_reason  # the run's own trial: no step ran for it
    assert not any("precision trial" in note for note in again.notes)


def test_a_search_stopped_by_ctrl_c_keeps_the_sizes_it_ran_and_the_command_says_them(monkeypatch, tmp_path):
    """Before, `redline memory --measure` stopped by Ctrl-C or SIGTERM ended without a word, its sizes lost."""
    from redline.cli import memory as memory_cli
    from redline.memory import search as search_module

    real_probe = search_module._probe

    def probe(task, options, measured, size, steps, order=None):
        if size == 8:
            raise KeyboardInterrupt
        return real_probe(task, options, measured, size, steps, order)

    monkeypatch.setattr(search_module, "_probe", probe)
    with pytest.raises(search_module.SearchStopped) as stopped:
        redline.find_batch_size(limited_task(6, "forward"), options=CPU, max_batch_size=64)
    assert isinstance(stopped.value, KeyboardInterrupt) and stopped.value.signum == 2
    assert [(size, ok) for size, ok, _ in stopped.value.tried] == [(1, True), (2, True), (4, True)]
    assert str(stopped.value) == (  # from Python it said "2", the signal's number
        "find_batch_size stopped by SIGINT after batch sizes 1 (fits), 2 (fits), 4 (fits); the largest that "
        "fitted: 4 (.tried holds them)"
    )

    def stopped_search(*args, **kwargs):
        raise stopped.value

    monkeypatch.setattr(memory_cli, "find_batch_size", stopped_search)
    with pytest.raises(StoppedBySignal) as said:
        memory_cli._measure(limited_task(6, "forward"), "fp32", "auto", 1, None, json_output=False)
    assert str(said.value) == (
        "stopped by Ctrl-C while measuring batch sizes: the largest batch that trained so far is 4 (1 trained, "
        "2 trained, 4 trained); a larger one may train too"
    )
    assert said.value.exit_code == 130
