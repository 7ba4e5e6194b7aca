"""What `redline launch` can tell is wrong before any worker starts is said then, not after a rendezvous or a wait."""

import pytest

from redline.errors import ConfigError
from redline.launch import torchrun
from redline.launch.torchrun import LaunchConfig


@pytest.fixture
def started(monkeypatch) -> list[object]:
    import torch.distributed.run

    runs: list[object] = []
    monkeypatch.setattr(torch.distributed.run, "run", runs.append)
    return runs


def test_a_module_that_is_nowhere_is_refused_before_any_worker_starts(tmp_path, monkeypatch, started):
    """Before, every worker started, failed alike with 'No module named ...', and the job failed with exit code 1."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"module 'nosuch_module_x' cannot be found: no 'nosuch_module_x' in .*\n"):
        torchrun.launch(LaunchConfig(nproc=2), ["nosuch_module_x", "--lr", "1"], module=True)
    assert started == []
    with pytest.raises(ConfigError, match=r"hint: did you mean -m redline\.train\?"):
        torchrun.launch(LaunchConfig(nproc=1), ["redlin.train"], module=True)


def test_a_scripts_file_name_given_as_a_module_names_both_ways_to_run_it(tmp_path, monkeypatch, started):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    with pytest.raises(ConfigError, match=r"module 'train\.py' is a file's name.*\n.*pass train\.py without --module"):
        torchrun.launch(LaunchConfig(nproc=1), ["train.py"], module=True)
    with pytest.raises(ConfigError, match=r"or train with it"):
        torchrun.launch(LaunchConfig(nproc=1), ["train.py"], module=True)
    assert started == []


def test_modules_python_finds_are_launched(tmp_path, monkeypatch, started):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mytrain.py").write_text("print('hi')\n")  # found in the working directory, as python -m finds it
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    for name in ("mytrain", "pkg.sub", "json.tool", "redline"):  # a submodule is the workers' to find
        torchrun.launch(LaunchConfig(nproc=1), [name], module=True)
    assert len(started) == 4


def test_a_package_without_a_main_is_refused_before_any_worker_starts(tmp_path, monkeypatch, started):
    """Before, `-m redline.examples` started every worker, each failing alike ("cannot be directly executed")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg" / "inner").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "inner" / "__init__.py").write_text("")
    for name in ("redline.examples", "pkg", "pkg.inner"):
        with pytest.raises(ConfigError, match=rf"module '{name}' is a package without a __main__\.py.*\nhint: name"):
            torchrun.launch(LaunchConfig(nproc=1), [name], module=True)
    assert started == []
    (tmp_path / "pkg" / "inner" / "__main__.py").write_text("")
    torchrun.launch(LaunchConfig(nproc=1), ["pkg.inner"], module=True)
    assert len(started) == 1


def test_a_master_addr_of_another_machine_for_a_job_on_one_is_refused_before_the_workers_wait(tmp_path, started):
    """Before, the workers looked for the launcher's rendezvous there, retrying for 15 minutes, stack traces and all."""
    script = tmp_path / "train.py"
    script.write_text("")
    elsewhere = "203.0.113.7"  # TEST-NET-3 (RFC 5737): no machine's own address
    with pytest.raises(
        ConfigError,
        match=r"master_addr='203\.0\.113\.7' is not allowed; expected an address or host "
        r"name of this machine for --nnodes 1\nhint: 203\.0\.113\.7 is not an address of this machine",
    ):
        torchrun.launch(LaunchConfig(nproc=2, master_addr=elsewhere), [str(script)])
    with pytest.raises(ConfigError, match=r"hint: no-such-host\.invalid cannot be resolved"):
        torchrun.launch(LaunchConfig(nproc=2, master_addr="no-such-host.invalid"), [str(script)])
    assert started == []
    for here in ("127.0.0.1", "localhost"):
        torchrun.launch(LaunchConfig(nproc=2, master_addr=here), [str(script)])
    several = LaunchConfig(nproc=1, nnodes=2, node_rank=1, master_addr=elsewhere, master_port=29500)
    torchrun.launch(several, [str(script)])  # node 0 is another machine: its address is not this one's
    assert len(started) == 3
