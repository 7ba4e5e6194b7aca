"""A module given to `redline launch -m` that python -m cannot run is named before any worker starts."""

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
