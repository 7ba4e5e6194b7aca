"""benchmarks/trial_cost.py: each entry's first trial is timed too, in fresh processes with empty caches."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import trial_cost  # the benchmarks folder is not a package


def test_each_entrys_first_trial_runs_in_a_fresh_process_with_empty_caches_in_rotated_order(monkeypatch):
    children: list[tuple[list[str], dict[str, str]]] = []

    def run(command, *, env, **_):
        children.append((command, env))
        index = int(command[command.index("--first") + 1])
        return subprocess.CompletedProcess(command, 0, stdout=f'RESULT {{"wall_s": {index + 1}.5}}\n', stderr="")

    monkeypatch.setattr(trial_cost.subprocess, "run", run)
    walls = trial_cost.first_trials("example:digits", 2, 2, None)
    assert walls == [[1.5, 1.5], [2.5, 2.5]]
    assert [command[command.index("--first") + 1] for command, _ in children] == ["0", "1", "1", "0"]
    for name in ("TORCHINDUCTOR_CACHE_DIR", "REDLINE_CACHE_DIR"):
        assert len({env[name] for _, env in children}) == 4  # a cache of its own for every process
