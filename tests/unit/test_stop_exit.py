"""A launcher sent a signal exits 128 + the signal when it stopped the workers, and 0 when they had finished."""

import logging
import signal

import pytest

from redline.errors import StoppedBySignal
from redline.launch.torchrun import LaunchStopped, stopped_by
from redline.parallel.env import FINISHED_ENV, DistEnv, mark_finished


def test_a_signal_that_stopped_the_workers_exits_128_plus_it_and_asks_for_resume(tmp_path):
    stopped = stopped_by(signal.SIGTERM, tmp_path / "finished")  # the workers never marked the run finished
    assert isinstance(stopped, LaunchStopped) and isinstance(stopped, StoppedBySignal)
    assert stopped.exit_code == 143
    assert str(stopped).startswith("stopped by SIGTERM: the launcher passed it to every worker")
    assert "hint: run the same command again with --resume auto" in str(stopped)
    # before, it promised a checkpoint "within two steps" even where the ranks were still setting up and wrote none
    assert "after the step under way" in str(stopped) and "none where they were still setting up" in str(stopped)
    assert stopped_by(signal.SIGINT, tmp_path / "finished").exit_code == 130


def test_a_signal_after_the_workers_finished_exits_0_without_asking_for_resume(tmp_path, monkeypatch, caplog):
    finished = tmp_path / "finished"
    monkeypatch.setenv(FINISHED_ENV, str(finished))  # as the launcher starts its workers
    mark_finished(DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2))  # one machine's second worker
    assert not finished.exists(), "the machine's first worker writes the mark"
    mark_finished(DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2))
    with caplog.at_level(logging.INFO, logger="redline"):
        assert stopped_by(signal.SIGTERM, finished) is None
    assert [r.getMessage() for r in caplog.records] == [
        "SIGTERM arrived after the workers had finished their work: nothing to resume"
    ]


def test_without_a_launcher_nothing_is_marked(tmp_path, monkeypatch):
    monkeypatch.delenv(FINISHED_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    mark_finished(DistEnv())
    assert list(tmp_path.iterdir()) == []


def test_a_stopped_script_of_the_users_is_not_told_to_pass_the_trainers_resume_flag(tmp_path, monkeypatch):
    """Before, every launch stopped by a signal said to rerun with --resume auto, an option a script may not take."""
    import pytest
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from redline.launch.torchrun import LaunchConfig, launch

    def preempted(args: object) -> None:
        raise SignalException("preempted", sigval=signal.SIGTERM)

    monkeypatch.setattr(torch.distributed.run, "run", preempted)
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(LaunchStopped) as own:
        launch(LaunchConfig(nproc=2), [str(script), "--epochs", "3"])
    assert (
        own.value.exit_code == 143 and "--resume auto" not in str(own.value) and "Trainer's ranks" not in str(own.value)
    )
    assert "hint: run the same command again to continue; a script that trains with redline's Trainer" in str(own.value)
    with pytest.raises(LaunchStopped) as trainer:
        launch(LaunchConfig(nproc=2), ["redline", "train", "--task", "example:digits"], module=True)
    assert "hint: run the same command again with --resume auto" in str(trainer.value)


def test_a_trainer_a_signal_to_its_workers_stopped_exits_as_a_stopped_run_not_0(tmp_path, monkeypatch):
    """Before, `kill` of one worker of `redline train --nproc 2` stopped the run (every rank checkpoints and exits 0),
    and the launcher exited 0 as if the run had finished: a scheduler took the unfinished job for done."""
    import os

    import pytest
    import torch.distributed.run

    from redline.launch.torchrun import LaunchConfig, launch

    def stopped_by_a_signal_to_a_worker(args: object) -> None:
        return None  # the ranks stopped together and exited 0; no worker marked the run finished

    def finished(args: object) -> None:
        open(os.environ[FINISHED_ENV], "x").close()  # what mark_finished does on the machine's first worker

    trainer = ["redline", "train", "--task", "example:digits", "--out", str(tmp_path)]
    monkeypatch.setattr(torch.distributed.run, "run", stopped_by_a_signal_to_a_worker)
    with pytest.raises(LaunchStopped) as stopped:
        launch(LaunchConfig(nproc=2), trainer, module=True)
    assert stopped.value.exit_code == 143
    assert str(stopped.value).startswith(
        "stopped by a signal sent to the workers, not to the launcher: the Trainer's ranks stopped together before "
        "the run had finished its work"
    )
    assert "hint: run the same command again with --resume auto" in str(stopped.value)
    script = tmp_path / "train.py"
    script.write_text("")
    launch(LaunchConfig(nproc=2), [str(script)])  # a script that ran no Trainer marks nothing: its exit 0 is its own
    launch(LaunchConfig(nproc=1), ["redline", "train", "--help"], module=True)  # the help trains nothing
    monkeypatch.setattr(torch.distributed.run, "run", finished)
    launch(LaunchConfig(nproc=2), trainer, module=True)  # the run finished its work: 0, as before


def test_a_stopped_launch_names_the_newest_checkpoint_under_out_or_that_there_is_none():
    from pathlib import Path

    at = LaunchStopped(signal.SIGTERM).named((240, Path("runs/p/checkpoints/step-00000240")))
    assert at.exit_code == 143 and str(at) == (
        "stopped by SIGTERM: the launcher passed it to every worker; the newest checkpoint under --out is step 240, "
        "at runs/p/checkpoints/step-00000240\nhint: run the same command again with --resume auto to continue from it"
    )
    none = LaunchStopped(signal.SIGINT, workers_only=True).named(None)
    assert none.exit_code == 130 and str(none).startswith(
        "stopped by a signal sent to the workers, not to the launcher: the Trainer's ranks stopped together before "
        "the run had finished its work; no checkpoint was written under --out"
    )
    assert str(none).endswith("signal the launcher (it passes the signal on to every worker)")


def test_a_script_whose_trainer_a_signal_to_its_workers_stopped_exits_as_a_stopped_run_not_0(tmp_path, monkeypatch):
    """The README promised 143 for a signal sent to the workers alone; a script of the user's that trains with the
    Trainer exited 0, since only `redline train`'s launch looked for the finished mark."""
    import pytest
    import torch.distributed.run

    from redline.launch.torchrun import LaunchConfig, launch

    def trainer_stopped_by_a_signal(args: object) -> None:  # what each rank's fit() does as it returns
        for rank in range(2):
            mark_finished(DistEnv(rank=rank, world_size=2, local_rank=rank, local_world_size=2), signalled=True)

    monkeypatch.setattr(torch.distributed.run, "run", trainer_stopped_by_a_signal)
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(LaunchStopped) as stopped:
        launch(LaunchConfig(nproc=2), [str(script)])
    assert stopped.value.exit_code == 143 and "--resume auto" not in str(stopped.value)
    assert str(stopped.value).startswith("stopped by a signal sent to the workers, not to the launcher: the Trainer's")
    assert "run the same command again; with resume='auto' in its TrainerConfig it continues" in str(stopped.value)


def test_torchruns_agent_does_not_narrate_the_stop_the_launcher_says_itself(tmp_path, monkeypatch, caplog):
    """Before, "Received 15 death signal, shutting down workers" came on every stop: torch gives its agent's logger a
    level of its own, which quieting "torch.distributed.elastic" did not reach."""
    import torch.distributed.run

    from redline.launch.torchrun import LaunchConfig, launch

    def narrating(args: object) -> None:
        agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
        agent.warning("Received 15 death signal, shutting down workers")
        agent.error("failed (exitcode: -9) local_rank: 1")  # a worker's one word a restart hid: kept

    monkeypatch.setattr(torch.distributed.run, "run", narrating)
    script = tmp_path / "train.py"
    script.write_text("")
    with caplog.at_level(logging.INFO):
        launch(LaunchConfig(nproc=1), [str(script)])
    said = [r.getMessage() for r in caplog.records if r.name.startswith("torch")]
    assert said == ["failed (exitcode: -9) local_rank: 1"]
    assert logging.getLogger("torch.distributed.elastic.agent.server.api").level == logging.WARNING  # put back


def test_a_stopped_launch_without_out_says_nothing_was_saved_rather_than_to_resume(tmp_path):
    """`redline train --nproc 2` without --out, stopped: it was told to rerun with --resume auto, which is refused
    without --out."""
    from redline.cli.train import launch_stopped

    stops = [
        LaunchStopped(signal.SIGINT),  # Ctrl-C to the launcher
        LaunchStopped(signal.SIGTERM, workers_only=True),  # a kill of the workers alone
        LaunchStopped(signal.SIGINT, aborted="stopping"),  # a second Ctrl-C
    ]
    for stopped in stops:
        for node_rank in (None, 0, 1):
            said = str(launch_stopped(stopped, None, node_rank))
            assert "nothing was saved: the run has no --out\nhint: pass --out DIR" in said, said
            assert "run the same command again with --resume auto" not in said, said
            assert launch_stopped(stopped, None, node_rank).exit_code == stopped.exit_code
    with_out = str(launch_stopped(LaunchStopped(signal.SIGINT), tmp_path, 0))  # --out, stopped before its first
    assert "no checkpoint was written under --out" in with_out and "run the same command again" in with_out


def test_an_unwritable_finished_mark_warns_and_the_run_ends_as_it_would(tmp_path, monkeypatch):
    afile = tmp_path / "a-file"
    afile.write_text("")
    monkeypatch.setenv(FINISHED_ENV, str(afile / "finished"))  # set by hand into a file: no folder to write in
    with pytest.warns(UserWarning, match="could not mark the run's end for its launcher") as caught:
        mark_finished(DistEnv(), signalled=True, received=True)
    assert "unset it where it was set by hand" in str(caught[0].message)
