"""The hang watchdog: diagnose() on positions as data, the watchdog in one process, and a real 2-rank hang.

The hangs are this file run as a script (``python test_watchdog.py DIR``, rank and world size from the
environment as torchrun sets them): two ranks over gloo all-reduce each step; rank 1 sleeps for a minute
inside its forward of step 5, and only the watchdog ends the job.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from redline.errors import SAID_ERRORS_ENV, ConfigError
from redline.parallel.watchdog import (
    HANG_EXIT_CODE,
    START_ALLOWANCE_S,
    Position,
    Watchdog,
    diagnose,
    enable_torch_debug,
)

NOW = 1_000_000.0
STALL_STEP = 5
TIMEOUT_S = 3.0


def at(step: int, where: str, beats: int, ago: float, collectives: int | None = None, **kw: str) -> Position:
    return Position(step=step, where=where, beats=beats, time=NOW - ago, collectives=collectives, **kw)


# -- diagnose: who stalled, decided from the records alone ----------------------------------------


def test_the_rank_behind_is_named_with_where_it_stands_and_what_the_others_wait_in() -> None:
    records = {
        0: at(7, "backward (gradient all-reduce)", 2, ago=12.3, collectives=15, collective="in #15 gloo:all_reduce"),
        1: at(7, "forward", 1, ago=12.4, collectives=14, collective="none pending", stack="runs/x/hang-rank1.txt"),
    }
    hang = diagnose(records, now=NOW, timeout_s=10, world_size=2)
    assert hang is not None and hang.stalled == (1,)
    lines = hang.message.splitlines()
    assert lines[0] == "hang: rank 1 stopped at step 7 in 'forward', and the others wait for it (hang timeout 10 s)"
    assert "  stalled rank 1: step 7, 'forward', last beat 12.4 s ago; collective: none pending" in lines
    assert (
        "  waiting rank 0: step 7, 'backward (gradient all-reduce)', last beat 12.3 s ago; "
        "collective: in #15 gloo:all_reduce"
    ) in lines
    assert "  stacks: runs/x/hang-rank1.txt" in lines
    assert "  no stack from rank 0: dead, stopped, out of its loop, or holding the GIL" in lines
    assert lines[-1].startswith("hint: the stack of rank 1 shows where it is stuck")


def test_ranks_waiting_in_one_collective_with_different_operations_are_a_mismatch_not_a_slow_rank() -> None:
    """rt.save under `if rank == 0`: rank 0 all-gathers where rank 1 all-reduces its gradients, both collective #10."""
    loop, backward = "the loop between optimizer steps (data, forward, loss)", "backward (gradient all-reduce)"
    records = {
        0: at(5, loop, 1, ago=9, collectives=10, collective="in #10 gloo:all_gather(long[1])"),
        1: at(5, backward, 2, ago=9, collectives=10, collective="in #10 gloo:all_reduce(float[29066])"),
    }
    hang = diagnose(records, now=NOW, timeout_s=8, world_size=2)
    assert hang is not None
    assert hang.message.startswith(
        "hang: collective mismatch: the ranks wait in collective #10 with different operations: "
        "rank 0 in gloo:all_gather(long[1]), rank 1 in gloo:all_reduce(float[29066]) (hang timeout 8 s)"
    )
    hint = hang.message.splitlines()[-1]
    assert hint.startswith("hint: a collective called on some ranks only (e.g. rt.save under `if rank == 0`")
    assert "raise --hang-timeout" not in hint
    assert "ranks that ran different numbers of steps (a loop over data of another length on each rank" in hint
    same = {r: dataclasses.replace(p, collective="in #10 gloo:all_reduce(float[29066])") for r, p in records.items()}
    assert "mismatch" not in str(diagnose(same, now=NOW, timeout_s=8, world_size=2))


def test_no_hang_while_every_rank_beat_within_the_timeout() -> None:
    records = {0: at(3, "forward", 1, ago=9.9), 1: at(2, "forward", 1, ago=0.1)}
    assert diagnose(records, now=NOW, timeout_s=10, world_size=2) is None


def test_all_ranks_stuck_at_the_same_point_blames_the_collective_not_a_rank() -> None:
    records = {r: at(4, "backward", 2, ago=31, collectives=9, collective="in #9 nccl:all_reduce") for r in range(4)}
    hang = diagnose(records, now=NOW, timeout_s=30, world_size=4)
    assert hang is not None and hang.stalled == (0, 1, 2, 3)
    assert hang.message.startswith("hang: all 4 ranks stopped at step 4 in 'backward', none behind the others")
    assert "  stalled ranks 0-3: step 4, 'backward', last beat 31.0 s ago; collective: in #9 nccl:all_reduce" in (
        hang.message.splitlines()
    )
    assert "the collective itself does not complete" in hang.message


def test_a_rank_that_never_beat_is_behind_every_rank_that_did() -> None:
    records = {0: at(0, "backward", 2, ago=20), 1: at(-1, "start", 0, ago=25), 2: at(0, "backward", 2, ago=20)}
    hang = diagnose(records, now=NOW, timeout_s=10, world_size=3)
    assert hang is not None and hang.stalled == (1,)
    assert hang.message.startswith("hang: rank 1 stopped before its first beat, and the others wait for it")
    assert "waiting ranks 0, 2: step 0, 'backward'" in hang.message


def test_a_rank_without_a_record_never_started_its_watchdog() -> None:
    records = {0: at(0, "backward", 2, ago=20), 2: at(0, "backward", 2, ago=20)}
    hang = diagnose(records, now=NOW, timeout_s=10, world_size=3)
    assert hang is not None and hang.stalled == (1,)
    assert hang.message.startswith("hang: rank 1 never started a watchdog, and the others wait for it")
    assert "no stack from ranks 0-2" in hang.message


def test_clocks_that_disagree_change_neither_the_verdict_nor_who_is_named() -> None:
    # rank 1's host clock runs 30 s ahead: its beat looks like it comes from the future
    skewed = {0: at(5, "backward", 2, ago=12, collectives=11), 1: at(5, "forward", 1, ago=-30, collectives=10)}
    hang = diagnose(skewed, now=NOW, timeout_s=10, world_size=2)
    assert hang is not None and hang.stalled == (1,)
    assert "stalled rank 1: step 5, 'forward', last beat 0.0 s ago" in hang.message  # clamped, never negative
    # a clock behind by less than the timeout does not make a healthy job hang
    assert (
        diagnose({0: at(5, "forward", 1, ago=4), 1: at(5, "forward", 1, ago=-4)}, now=NOW, timeout_s=5, world_size=2)
        is None
    )


def test_collectives_entered_decide_before_beats() -> None:
    # rank 0 beat once more in step 9 (a checkpoint only it writes) but has not entered collective #21
    records = {
        0: at(9, "checkpoint", 3, ago=15, collectives=20),
        1: at(9, "backward (gradient all-reduce)", 2, ago=15, collectives=21),
    }
    hang = diagnose(records, now=NOW, timeout_s=10, world_size=2)
    assert hang is not None and hang.stalled == (0,)
    without_recorder = {r: dataclasses.replace(p, collectives=None) for r, p in records.items()}
    hang = diagnose(without_recorder, now=NOW, timeout_s=10, world_size=2)
    assert hang is not None and hang.stalled == (1,)  # beats alone: the best guess left
    assert "collective: unknown" in hang.message and "TORCH_FR_BUFFER_SIZE=2000" in hang.message


def test_flight_recorder_variables_use_the_names_of_the_torch_at_hand_and_leave_the_users_alone(
    tmp_path: Path,
) -> None:
    prefix = str(tmp_path / "flight_recorder" / "rank_")
    assert enable_torch_debug({}, tmp_path, torch_version="2.13.0+cpu") == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }
    assert enable_torch_debug({}, tmp_path, torch_version="2.6.0") == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    # the user's own buffer size, under the old name, stays the only one
    assert enable_torch_debug({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, torch_version="2.13") == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"
    }


def test_a_timeout_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"hang_timeout=0 is not allowed; expected a number > 0"):
        Watchdog(dist.HashStore(), 0, 1, 0)
    with pytest.raises(ConfigError, match=r"hang_start_timeout=0 is not allowed; expected a number > 0"):
        Watchdog(dist.HashStore(), 0, 1, 5, start_timeout_s=0)


def test_the_start_allowance_is_ten_minutes_unless_the_timeout_or_the_user_says_more() -> None:
    assert Watchdog(dist.HashStore(), 0, 1, 5).start_timeout_s == START_ALLOWANCE_S == 600
    assert Watchdog(dist.HashStore(), 0, 1, 900).start_timeout_s == 900
    assert Watchdog(dist.HashStore(), 0, 1, 5, start_timeout_s=2).start_timeout_s == 2


def test_a_hang_in_the_first_step_is_reported_against_the_start_allowance_and_names_its_flag() -> None:
    records = {0: at(1, "forward and backward", 1, ago=40), 1: at(1, "forward and backward", 2, ago=1)}
    hang = diagnose(records, now=NOW, timeout_s=30, world_size=2, starting=True)
    assert hang is not None and hang.stalled == (0,)
    assert "(hang start timeout 30 s, for the set-up and first step)" in hang.message.splitlines()[0]
    assert "(building, loading, a first compile), raise --hang-start-timeout" in hang.message


# -- the watchdog in this process: the exit is recorded instead of taken ---------------------------


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def watched(
    store: dist.Store, rank: int, world: int, timeout_s: float, out: Path | None, start_timeout_s: float | None = None
) -> tuple[Watchdog, Exits]:
    watchdog, exits = Watchdog(store, rank, world, timeout_s, out, start_timeout_s=start_timeout_s), Exits()
    watchdog._exit = exits
    return watchdog, exits


def stuck_in_forward(exits: Exits) -> None:
    exits.done.wait(20)  # stands for a step that never returns; the recorded exit releases it


def test_a_loop_that_keeps_beating_never_fires_even_after_a_restart_from_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = dist.HashStore()
    store.add("redline/watchdog/attempt_0/hang", 1)  # torchrun's first attempt hung; its store lives on
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    watchdog, exits = watched(store, 0, 1, 1.0, None)
    with watchdog:
        for step in range(15):  # six polls of the watchdog, none of them a second after a beat
            watchdog.beat(step, "forward")
            time.sleep(0.1)
    assert exits.codes == []
    assert b'"where": "left the watched loop"' in store.get("redline/watchdog/attempt_1/0")


def test_the_set_up_and_first_step_have_the_start_allowance_and_later_steps_the_timeout(tmp_path: Path) -> None:
    store = dist.HashStore()
    watchdog, exits = watched(store, 0, 1, 0.3, tmp_path, start_timeout_s=30)
    with watchdog:
        time.sleep(1.0)  # the set-up: no beat yet
        watchdog.beat(1, "forward")
        time.sleep(1.0)  # the first step: a compile, say
        watchdog.beat(1, "logging")
        quiet_through_the_start = list(exits.codes)
        watchdog.beat(2, "forward")  # the first step is done: from here on, 0.3 s
        stuck_in_forward(exits)
    assert quiet_through_the_start == []
    assert exits.codes == [HANG_EXIT_CODE]
    assert (tmp_path / "hang.txt").read_text().startswith("hang: rank 0 stopped at step 2 in 'forward' (hang timeout")


def test_a_rank_stuck_in_its_first_step_fires_at_the_start_allowance(tmp_path: Path) -> None:
    watchdog, exits = watched(dist.HashStore(), 0, 1, 30, tmp_path, start_timeout_s=0.4)
    with watchdog:
        watchdog.beat(5, "forward")  # resumed at step 4: its first step is 5
        stuck_in_forward(exits)
    assert exits.codes == [HANG_EXIT_CODE]
    report = (tmp_path / "hang.txt").read_text()
    assert report.startswith("hang: rank 0 stopped at step 5 in 'forward' (hang start timeout 0.4 s, for the set-up")
    assert "raise --hang-start-timeout" in report


def test_a_stalled_rank_writes_its_stack_and_the_report_then_exits(tmp_path: Path) -> None:
    watchdog, exits = watched(dist.HashStore(), 0, 1, 0.4, tmp_path)
    with watchdog:
        watchdog.beat(2, "forward")
        watchdog.beat(3, "forward")  # past its first step: the timeout applies
        stuck_in_forward(exits)
    assert exits.codes == [HANG_EXIT_CODE]
    assert "stuck_in_forward" in (tmp_path / "hang-rank0.txt").read_text()
    report = (tmp_path / "hang.txt").read_text()
    assert report.startswith("hang: rank 0 stopped at step 3 in 'forward' (hang timeout 0.4 s)")


@pytest.mark.parametrize("launched", [False, True])
def test_the_diagnosis_is_printed_once_under_redlines_launcher_which_prints_it_from_torchruns_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, launched: bool
) -> None:
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    if launched:  # the launcher's folder of errors printed: it prints the hang from the error file itself
        monkeypatch.setenv(SAID_ERRORS_ENV, str(tmp_path))
    watchdog, exits = watched(dist.HashStore(), 0, 1, 0.4, tmp_path)
    with caplog.at_level(logging.ERROR, logger="redline"), watchdog:
        watchdog.beat(2, "forward")
        watchdog.beat(3, "forward")
        stuck_in_forward(exits)
    report = (tmp_path / "hang.txt").read_text().strip()
    said = [r.getMessage() for r in caplog.records]
    assert (report in said) is not launched
    assert any("stack in" in line for line in said) is launched
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == f"HangError: {report}"


def test_a_fresh_rank_dumps_too_when_another_fired_and_gives_torchrun_its_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    store = dist.HashStore()
    watchdog, exits = watched(store, 0, 2, 30, tmp_path)
    start = time.monotonic()
    with watchdog:
        watchdog.beat(8, "backward")
        store.add("redline/watchdog/attempt_0/hang", 1)  # rank 1 fired first and reported
        store.set("redline/watchdog/attempt_0/report", "hang: rank 1 stopped at step 8 in 'forward'")
        stuck_in_forward(exits)
    assert exits.codes == [HANG_EXIT_CODE]
    assert time.monotonic() - start < 3  # one poll, not the 5 s a rank waits for a report that never comes
    assert (tmp_path / "hang-rank0.txt").exists() and not (tmp_path / "hang.txt").exists()  # rank 1 reports
    error = json.loads((tmp_path / "error.json").read_text())["message"]
    assert error["message"] == "HangError: hang: rank 1 stopped at step 8 in 'forward'"


# -- a real hang: 2 processes over gloo ------------------------------------------------------------


def slow_forward() -> None:
    time.sleep(60)  # far past the timeout: only the watchdog ends this job


def worker(out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    os.environ.update(enable_torch_debug(os.environ, out))  # before the group exists: the recorder reads it then
    torch.set_num_threads(1)  # two ranks share two cores
    if "TORCHELASTIC_USE_AGENT_STORE" in os.environ:  # under torchrun, whose agent hosts the store
        store: dist.Store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    else:
        store = dist.FileStore(str(out / "store"), world)
    # gloo's own timeout is far longer than the watchdog's, so the watchdog is what fires
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=dt.timedelta(seconds=120))
    grad = torch.ones(8)
    with Watchdog(store, rank, world, TIMEOUT_S, out) as watchdog:
        for step in range(1000):
            watchdog.beat(step, "forward")
            if rank == 1 and step == STALL_STEP:
                (out / "stalled-at").write_text(repr(time.time()))
                slow_forward()
            watchdog.beat(step, "backward (gradient all-reduce)")
            dist.all_reduce(grad)
    dist.destroy_process_group()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's bookkeeping is left


def worker_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob("pid-rank*"))]


def kill_leftovers(procs: list[subprocess.Popen[bytes]], out: Path) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for pid in worker_pids(out):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def assert_rank_1_is_named(out: Path) -> None:
    report = (out / "hang.txt").read_text()
    assert report.startswith("hang: rank 1 stopped at step 5 in 'forward', and the others wait for it"), report
    assert "waiting rank 0: step 5, 'backward (gradient all-reduce)'" in report, report
    assert "gloo:all_reduce(float[8])" in report, report  # the collective rank 0 waits in, from the flight recorder
    assert "slow_forward" in (out / "hang-rank1.txt").read_text()
    assert "all_reduce" in (out / "hang-rank0.txt").read_text()
    assert (out / "flight_recorder" / "rank_0").stat().st_size > 0  # the recorder's raw dump


def test_a_rank_asleep_in_its_forward_fails_the_job_naming_it_and_every_rank_exits(tmp_path: Path) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"}
            with open(tmp_path / f"rank{rank}.log", "w") as log:
                procs.append(
                    subprocess.Popen([sys.executable, __file__, str(tmp_path)], env=env, stdout=log, stderr=log)
                )
        deadline = time.monotonic() + 90
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = time.time()
    finally:
        kill_leftovers(procs, tmp_path)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text() for r in range(2))
    assert [p.returncode for p in procs] == [HANG_EXIT_CODE, HANG_EXIT_CODE], logs  # each rank's own watchdog
    assert ended - float((tmp_path / "stalled-at").read_text()) < TIMEOUT_S + 10
    assert_rank_1_is_named(tmp_path)
    assert "hang: rank 1 stopped at step 5 in 'forward'" in logs  # on the reporting rank's stderr too
    assert not [pid for pid in worker_pids(tmp_path) if alive(pid)]


def test_under_torchrun_the_failure_summary_carries_the_diagnosis(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(tmp_path)]
    torchrun = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output = torchrun.communicate(timeout=90)[0].decode()
    finally:
        kill_leftovers([torchrun], tmp_path)
    assert torchrun.returncode != 0, output
    assert f"exitcode  : {HANG_EXIT_CODE}" in output, output
    assert "HangError: hang: rank 1 stopped at step 5 in 'forward'" in output, output
    assert_rank_1_is_named(tmp_path)
    assert len(worker_pids(tmp_path)) == 2 and not [pid for pid in worker_pids(tmp_path) if alive(pid)]


if __name__ == "__main__":
    worker(Path(sys.argv[1]))


class _Beats:
    """A stand-in watchdog that records each beat."""

    def __init__(self) -> None:
        self.beats: list[tuple[int, str]] = []

    def beat(self, step: int, where: str) -> None:
        self.beats.append((step, where))

    def __enter__(self) -> _Beats:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_a_rank_reading_its_next_batch_is_said_to_be_reading_it_not_in_the_last_steps_backward(monkeypatch) -> None:
    # A rank stuck in its dataset's __getitem__ after step 12 was reported in 'forward and backward (gradient
    # all-reduce)' of step 12, which sent the user to DDP's communication instead of their data.
    import redline
    from redline.train import trainer as trainer_module

    beats = _Beats()
    monkeypatch.setattr(trainer_module, "hang_watchdog", lambda *args: beats)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    task = redline.Task(model=lambda: torch.nn.Linear(4, 2), loss_fn=torch.nn.functional.cross_entropy,
                        train_data=data, batch_size=8)  # fmt: skip
    with trainer_module.Trainer(task, max_steps=3, progress=False, trial="off") as trainer:
        trainer.fit()
    reading = [step for step, where in beats.beats if where.startswith("reading the next batch")]
    assert reading[:3] == [0, 1, 2]  # after step N: a rank reading is not ahead of one that evaluates step N
    for step in (1, 2, 3):  # each step's batch is read before its forward
        at = beats.beats.index((step, "forward and backward (gradient all-reduce)"))
        assert beats.beats[at - 1][1].startswith("reading the next batch") and beats.beats[at - 1][0] == step - 1
