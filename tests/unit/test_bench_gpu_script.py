"""benchmarks/gpu/bench.sh: each run starts with empty caches, though its results folder persists."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu" / "bench.sh"


def test_a_second_run_into_the_same_folder_reads_nothing_the_first_cached(tmp_path):
    seen = tmp_path / "seen.txt"
    python = tmp_path / "python"  # stands in for every step's Python: notes the caches it was given
    python.write_text(f'#!/bin/sh\necho "$REDLINE_CACHE_DIR $TORCHINDUCTOR_CACHE_DIR" >> {seen}\n')
    python.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(python), "DEVICE": "cpu", "QUICK": "1"}
    for _ in range(2):
        subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, check=True, timeout=60)
    runs = [set(line.split()) for line in seen.read_text().splitlines()]
    first, second = runs[0], runs[-1]
    assert len(first) == 2 and first.isdisjoint(second)
    assert all(line == runs[0] for line in runs[: len(runs) // 2])  # one run's steps share its caches (tune, tuned)
    assert not any(Path(folder).exists() for folder in first)  # removed when its run ended
