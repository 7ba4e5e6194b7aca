"""How a failed launched job is described, the failed ranks apart from those the launcher stopped, and its exit."""

import signal

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from redline.launch.torchrun import _failure


def failed(**codes: int) -> ChildFailedError:
    failures = {int(rank[1:]): ProcessFailure(int(rank[1:]), 100, code, "") for rank, code in codes.items()}
    return ChildFailedError("redline", failures)


def test_the_rank_that_failed_is_named_and_those_the_launcher_stopped_after_it_are_told_apart():
    message = str(_failure(failed(r0=-signal.SIGTERM, r1=1, r2=-signal.SIGTERM), hang_exit_code=86))
    assert "the launched job failed: rank 1 exited with 1 (then the launcher stopped ranks 0, 2)" in message


def test_signals_are_named_and_a_sigkill_points_at_the_hosts_memory():
    message = str(_failure(failed(r0=-signal.SIGKILL, r1=-signal.SIGTERM), hang_exit_code=86))
    assert "rank 0 was ended by SIGKILL (the kernel's out-of-memory killer" in message
    assert "(then the launcher stopped rank 1)" in message
    from_outside = str(_failure(failed(r0=-signal.SIGTERM, r1=-signal.SIGTERM), hang_exit_code=86))
    assert "rank 0 was ended by SIGTERM; rank 1 was ended by SIGTERM" in from_outside  # no rank failed first
    assert "rank 0 exited with 3" in str(_failure(failed(r0=3), hang_exit_code=86))


def test_the_job_exits_as_the_rank_that_failed_did_not_as_a_mistake():
    """A scheduler reads the worker's status: it was 2 (a mistake of the user's) whatever the worker did."""
    assert _failure(failed(r0=-signal.SIGTERM, r1=1, r2=-signal.SIGTERM), hang_exit_code=86).exit_code == 1
    assert _failure(failed(r0=3), hang_exit_code=86).exit_code == 3
    assert _failure(failed(r0=-signal.SIGKILL, r1=-signal.SIGTERM), hang_exit_code=86).exit_code == 128 + 9
    assert _failure(failed(r0=-signal.SIGTERM, r1=-signal.SIGTERM), hang_exit_code=86).exit_code == 128 + 15
    hang = failed(r0=86, r1=-signal.SIGTERM)
    hang.failures[0].message = "hang: rank 0 stopped at step 5"
    error = _failure(hang, hang_exit_code=86)
    assert (str(error), error.exit_code) == ("hang: rank 0 stopped at step 5", 86)


def test_an_error_the_workers_meet_alike_is_printed_once_per_attempt(tmp_path, monkeypatch):
    from redline.errors import SAID_ERRORS_ENV, first_to_say

    monkeypatch.delenv(SAID_ERRORS_ENV, raising=False)
    assert first_to_say("boom") and first_to_say("boom")  # no launcher: every error is printed
    monkeypatch.setenv(SAID_ERRORS_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert first_to_say("boom")  # the first worker to meet it
    assert not first_to_say("boom")  # the others, meeting the same error
    assert first_to_say("another")  # a different error is printed too
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert first_to_say("boom")  # a restarted attempt says its error again
    monkeypatch.setenv(SAID_ERRORS_ENV, str(tmp_path / "gone"))
    assert first_to_say("boom") and first_to_say("boom")  # nowhere to mark: printing twice beats nothing


def test_the_workers_share_the_cores_unless_omp_num_threads_says_otherwise():
    from redline.launch.torchrun import worker_threads

    assert worker_threads(2, 16, {}) == 8  # torchrun alone would give each 1 and leave 14 cores idle
    assert worker_threads(8, 64, {}) == 8 and worker_threads(3, 2, {}) == 1  # never fewer than one
    assert worker_threads(2, 16, {"OMP_NUM_THREADS": "3"}) is None  # the user's choice stands
    assert worker_threads(1, 16, {}) is None  # one worker: torchrun sets nothing either


def test_a_job_that_used_up_its_restarts_says_every_attempt_failed():
    """Before, a job restarted twice read as one failure, as if --max-restarts had not been tried."""
    message = str(_failure(failed(r0=-signal.SIGTERM, r1=3), hang_exit_code=86, restarts=2))
    assert message.startswith(
        "the launched job failed in all 3 attempts (--max-restarts 2 used up); in the last: rank 1 exited with 3"
    )
    assert "attempts" not in str(_failure(failed(r1=3), hang_exit_code=86))  # none asked for: as before


def test_a_machine_of_a_job_on_several_says_whom_it_waits_for_before_torchrun_waits_in_silence(monkeypatch, caplog):
    """Before, a machine whose peers were not started yet printed nothing for the minutes torchrun waits."""
    import logging

    import torch.distributed.run

    from redline.launch import torchrun
    from redline.launch.torchrun import LaunchConfig
    from redline.launch.waiting import waiting_note

    logged_before_the_wait: list[str] = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: logged_before_the_wait.extend(caplog.messages))
    config = LaunchConfig(nproc=1, nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port=29500)
    with caplog.at_level(logging.INFO, logger="redline"):
        torchrun.launch(config, [__file__])
    assert (
        "this machine (node rank 0) waits for the other machine of --nnodes 2 at 10.0.0.1:29500, up to 900 s "
        "(--join-timeout): run the same command on each with its own --node-rank"
    ) in logged_before_the_wait
    endpoint = LaunchConfig(nproc=1, nnodes=3, rdzv_endpoint="head:29400")
    assert waiting_note(endpoint) == (
        "this machine waits for the other 2 machines of --nnodes 3 at head:29400, up to 900 s (--join-timeout): run "
        "the same command on each"
    )
    assert waiting_note(LaunchConfig(nproc=1)) is None  # one machine meets at once: nothing to say


def test_once_torchrun_handles_the_signals_the_waiting_guard_leaves_them_to_it(tmp_path):
    """A signal after the workers started is torchrun's to pass on to them: the guard must not end the launcher,
    even where torchrun was told to handle SIGINT alone (TORCHELASTIC_SIGNALS_TO_HANDLE)."""
    import subprocess
    import sys

    script = tmp_path / "guarded.py"
    script.write_text(
        "import os, signal, time\n"
        "from redline.launch.waiting import stoppable_while_waiting\n"
        "seen = []\n"
        "with stoppable_while_waiting('the others'):\n"
        "    signal.signal(signal.SIGINT, lambda s, f: seen.append(s))  # TORCHELASTIC_SIGNALS_TO_HANDLE=SIGINT\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(1)\n"
        "print('handled by torchrun:', seen)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"handled by torchrun: [{signal.SIGINT.value}]" in result.stdout and "stopped by" not in result.stderr


def test_the_hang_diagnosis_is_said_as_every_error_is_without_torchelastics_type_prefix(tmp_path, monkeypatch):
    from redline.parallel.watchdog import _record_for_torchrun

    error_file = tmp_path / "error.json"  # where the watchdog records its diagnosis for torchrun, as in a run
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    _record_for_torchrun("hang: rank 1 stopped at step 5")
    hung = ChildFailedError("redline", {1: ProcessFailure(1, 100, 86, str(error_file))})
    assert str(_failure(hung, hang_exit_code=86)) == "hang: rank 1 stopped at step 5"


def test_the_hint_points_at_errors_above_only_when_a_worker_printed_one():
    """Before, every failure said the workers' errors were printed above, even where no worker printed anything."""
    printed = str(_failure(failed(r0=2, r1=-signal.SIGTERM), hang_exit_code=86, printed=True))
    assert printed.endswith("hint: the workers' errors are printed above, each once")
    silent = str(_failure(failed(r0=-signal.SIGTERM, r1=3), hang_exit_code=86))
    assert "printed above" not in silent
    assert "rank 1's exit code 3 is the script's own (sys.exit(3) or os._exit(3))" in silent
    uncaught = str(_failure(failed(r0=1), hang_exit_code=86))
    assert "exit code 1 is Python's after an exception reached the top of the script" in uncaught
    killed = str(_failure(failed(r0=-signal.SIGTERM, r1=-signal.SIGKILL), hang_exit_code=86))
    assert "SIGKILL gives rank 1 no chance to print anything" in killed and "dmesg" in killed
    crashed = str(_failure(failed(r0=-signal.SIGSEGV, r1=-signal.SIGTERM), hang_exit_code=86))
    assert "rank 0 crashed in native code" in crashed and "PYTHONFAULTHANDLER=1" in crashed
    hung_up = str(_failure(failed(r0=-signal.SIGHUP), hang_exit_code=86))
    assert "the signal came from outside rank 0" in hung_up and "printed above" not in hung_up


def test_a_job_that_failed_after_the_trainer_finished_its_work_says_its_results_are_written():
    """Before, a worker that crashed after fit() read like any failure, as if the run's results were lost."""
    after = str(_failure(failed(r0=-signal.SIGTERM, r1=-signal.SIGSEGV), hang_exit_code=86, finished=True))
    assert after.startswith(
        "the launched job failed: rank 1 was ended by SIGSEGV (then the launcher stopped rank 0), after the Trainer "
        "had finished its work (with --out, its last checkpoint, final weights and summary are written)\nhint: "
    )
    assert "Trainer" not in str(_failure(failed(r1=-signal.SIGSEGV), hang_exit_code=86))  # it had not: as before


def test_the_launcher_reads_the_trainers_finished_mark_when_a_worker_fails(tmp_path, monkeypatch):
    import os

    import pytest
    import torch.distributed.run

    from redline.launch.torchrun import LaunchConfig, LaunchError, launch
    from redline.parallel.env import FINISHED_ENV

    def finished_then_crashed(args: object) -> None:
        open(os.environ[FINISHED_ENV], "x").close()  # what mark_finished does on the machine's first worker
        raise failed(r0=-signal.SIGTERM, r1=-signal.SIGSEGV)

    monkeypatch.setattr(torch.distributed.run, "run", finished_then_crashed)
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(LaunchError, match=r"SIGSEGV \(then the launcher stopped rank 0\), after the Trainer had fin"):
        launch(LaunchConfig(nproc=2), [str(script)])


def test_more_cpu_workers_than_cores_is_warned_before_they_start(tmp_path, monkeypatch, caplog):
    """Before, --nproc 40 on 2 cores without a GPU started 40 workers with only an info line that each ran 1 thread."""
    import logging

    import torch.distributed.run

    import redline.hardware.device as device
    from redline.hardware.device import Accelerators
    from redline.launch.torchrun import LaunchConfig, launch

    script = tmp_path / "train.py"
    script.write_text("")
    started: list[str] = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: started.append(args.nproc_per_node))
    monkeypatch.setattr(device, "usable_cpu_count", lambda: 2)

    def warnings(nproc: int, gpus: int) -> list[str]:
        monkeypatch.setattr(device, "probe_accelerators", lambda: Accelerators(cuda_count=gpus))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="redline"):
            launch(LaunchConfig(nproc=nproc), [str(script)])
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    assert warnings(40, gpus=0) == [
        "--nproc 40 starts 40 workers on the 2 cores here, with no GPU visible: they take turns on the cores, each "
        "step waits for the slowest, and each worker holds its own copy of torch, the model and the data in memory, "
        "so the job runs slower than on 2\nhint: pass --nproc 2 or fewer"
    ]
    assert started == ["40"], "a warning, not a refusal: the user may mean it"
    assert warnings(2, gpus=0) == []  # as many as the cores
    assert warnings(8, gpus=8) == []  # GPU workers: the cores only feed them


def test_a_machine_whose_ranks_only_saw_another_machines_rank_stop_says_the_cause_is_elsewhere(tmp_path, monkeypatch):
    """Before, the machine that did not crash said 'rank 0 exited with 2' and pointed at errors above, which only
    said that another rank stopped first: the cause was printed on the other machine."""
    from redline.cli.main import _say
    from redline.errors import PEER_STOPPED, SAID_ERRORS_ENV, TrainingError
    from redline.launch.torchrun import _peers_stopped

    monkeypatch.setenv(SAID_ERRORS_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    _say(TrainingError(f"step 3: a collective with the other ranks failed: closed\nhint: {PEER_STOPPED}"))
    monkeypatch.setenv("RANK", "2")
    _say(TrainingError("step 3: the model or loss raised RuntimeError: boom"))  # a failure of its own
    assert _peers_stopped(tmp_path, attempt=0) == {0}
    assert _peers_stopped(tmp_path, attempt=1) == set(), "with --max-restarts 1, the last attempt's ranks said none"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _say(TrainingError(f"step 5: a collective with the other ranks failed: closed\nhint: {PEER_STOPPED}"))
    assert _peers_stopped(tmp_path, attempt=1) == {2}
    error = _failure(failed(r0=2), hang_exit_code=86, printed=True, peers={0})
    assert str(error).startswith(
        "the launched job stopped because a rank on another machine failed: this machine's rank 0 only saw a "
        "collective with it break\nhint: the other machine's output says why"
    )
    assert error.exit_code == 2
    own = str(_failure(failed(r0=2, r2=1), hang_exit_code=86, printed=True, peers={0}))  # rank 2 failed here
    assert "another machine" not in own and "rank 2 exited with 1" in own
