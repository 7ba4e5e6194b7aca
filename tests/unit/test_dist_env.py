"""read_env: the launcher's variables read into a DistEnv, and the ones left over from elsewhere refused clearly."""

import pytest
import torch

from redline.errors import ConfigError
from redline.parallel.env import init_process_group, read_env


def test_no_variables_is_one_process():
    env = read_env({})
    assert (env.rank, env.world_size, env.distributed, env.launched) == (0, 1, False, False)


def test_a_launched_worker_reads_its_rank_and_the_world():
    env = read_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"})
    assert (env.rank, env.world_size, env.local_rank, env.launched) == (1, 2, 1, True)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set in the environment without RANK"),  # was a traceback from torch
        ({"WORLD_SIZE": "4", "RANK": ""}, "WORLD_SIZE=4 is set in the environment without RANK"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 and WORLD_SIZE=2 are inconsistent"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ],
)
def test_variables_that_name_no_rank_of_a_run_are_refused_with_the_fix(variables, message):
    with pytest.raises(ConfigError, match="^" + message) as refused:
        read_env(variables)
    assert "\nhint: " in str(refused.value) and "redline launch" in str(refused.value)


def test_world_size_one_without_rank_is_one_process_as_before():
    assert read_env({"WORLD_SIZE": "1"}).world_size == 1


def test_the_launchers_hang_timeouts_reach_the_worker():
    from redline.launch.torchrun import _hang_env

    worker = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env = read_env({**worker, **_hang_env(9.0, 60.0)})
    assert (env.hang_timeout_s, env.hang_start_timeout_s) == (9.0, 60.0)
    env = read_env({**worker, **_hang_env(9.0, None)})
    assert (env.hang_timeout_s, env.hang_start_timeout_s) == (9.0, 0.0)  # 0: the watchdog's own default


@pytest.mark.parametrize(
    ("given", "missing"), [({}, "MASTER_ADDR and MASTER_PORT"), ({"MASTER_ADDR": "h"}, "MASTER_PORT")]
)
def test_a_rank_without_the_address_where_the_ranks_meet_is_refused_before_joining(monkeypatch, given, missing):
    """RANK and WORLD_SIZE left over from another job: before, torch's ValueError from its rendezvous."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as refused:
        init_process_group(read_env({"RANK": "1", "WORLD_SIZE": "2"}), "cpu")
    assert str(refused.value).startswith(f"RANK=1 and WORLD_SIZE=2 are set in the environment without {missing},")
    assert "hint: unset RANK and WORLD_SIZE for one process" in str(refused.value)
    assert not torch.distributed.is_initialized()


def test_a_hang_timeout_left_in_the_shell_is_refused_by_the_launcher_before_any_worker_with_the_fix(monkeypatch):
    """Before, each worker refused it after it started, with the hint to launch with `redline launch`."""
    from redline.launch.torchrun import LaunchConfig, _watchdog_env

    monkeypatch.setenv("REDLINE_HANG_TIMEOUT", "abc")
    with pytest.raises(ConfigError) as refused:
        _watchdog_env(LaunchConfig(nproc=2))
    assert str(refused.value) == (
        "REDLINE_HANG_TIMEOUT='abc' is not a number of seconds\n"
        "hint: unset REDLINE_HANG_TIMEOUT, and give the launcher --hang-timeout S for a timeout"
    )
    given = _watchdog_env(LaunchConfig(nproc=2, hang_timeout_s=9.0))  # the launcher's own value replaces it
    assert given["REDLINE_HANG_TIMEOUT"] == "9.0"
    monkeypatch.delenv("REDLINE_HANG_TIMEOUT")
    assert _watchdog_env(LaunchConfig(nproc=2)) == {}
