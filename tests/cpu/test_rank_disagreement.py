"""A job whose ranks disagree is told so in one line, not in torch's traceback."""

import subprocess
import sys
from pathlib import Path

TASKS = Path(__file__).with_name("rank_tasks.py")


def train_two_ranks(task: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "redline", "train", "--task", f"{TASKS}:{task}", "--nproc", "2", "--devices", "cpu",
         "--no-progress", *args],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_ranks_given_models_of_other_shapes_are_refused_under_ddp_as_under_fsdp():
    """DDP's wrap compared the shapes first: 40 lines of torch's traceback ("params[0] in this process with sizes
    [8, 4] appears not to match"), exit 1."""
    result = train_two_ranks("width", "--max-steps", "2", "--strategy", "ddp")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "the ranks of this job were given different settings: model (structure and shapes) is" in result.stderr
    assert "Traceback" not in result.stderr and "appears not to match" not in result.stderr, result.stderr[-3000:]
