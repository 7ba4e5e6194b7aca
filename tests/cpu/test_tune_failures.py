"""`redline tune` on a task none of whose candidates runs: the error names the command that shows the failing line."""

import pytest

from redline.cli.tune import tune_command
from redline.errors import TrainingError

BROKEN = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from redline import Task

def mlp(features="7"):
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    return Task(model=lambda: nn.Linear(int(features), 3), loss_fn=nn.functional.cross_entropy,
                train_data=TensorDataset(x, y), batch_size=16, name="mlp")
"""


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "cache"))


def test_a_tune_that_ran_nothing_names_the_one_step_run_with_the_task_as_typed(tmp_path):
    # It said `redline train --task SPEC --max-steps 1`, where `redline bench` says the task and its arguments.
    (tmp_path / "broken tasks.py").write_text(BROKEN)  # the data has 8 features, the model takes 7
    spec = f"{tmp_path / 'broken tasks.py'}:mlp"
    with pytest.raises(TrainingError, match=r"no candidate of mlp ran") as refused:
        tune_command(task=spec, task_arg=["features=7"], devices="cpu", budget=5.0, planned_steps=None,
                     batch_size=8, steps=1, json_output=False)  # fmt: skip
    hint = str(refused.value).split("\nhint: ")[-1]
    expected = f"'{spec}' --task-arg features=7 --batch-size 8 --devices cpu --max-steps 1"
    assert f"`redline train --task {expected}` runs one step" in hint, hint
    assert "SPEC" not in hint


def test_profile_and_bench_name_the_one_step_run_with_the_task_as_typed(tmp_path, capsys):
    # profile said `redline train --task SPEC --max-steps 1` (bench and tune said the task as typed)
    from redline.cli.bench import bench as bench_command
    from redline.cli.profile import profile_command

    (tmp_path / "broken tasks.py").write_text(BROKEN)
    spec = f"{tmp_path / 'broken tasks.py'}:mlp"
    with pytest.raises(TrainingError) as profiled:
        profile_command(task=spec, task_arg=["features=7"], devices="cpu", precision="fp32", compile="off",
                        batch_size=8, steps=1, warmup=1)  # fmt: skip
    expected = f"`redline train --task '{spec}' --task-arg features=7 --batch-size 8 --devices cpu --max-steps 1` runs"
    assert expected in str(profiled.value) and "SPEC" not in str(profiled.value)
    with pytest.raises(TrainingError) as benched:
        bench_command(task=spec, task_arg=["features=7"], devices="cpu", precision="fp32", compile="off",
                      batch_size="8", steps=10, auto=False)  # fmt: skip
    assert expected in str(benched.value) and "SPEC" not in str(benched.value)


def test_a_model_factory_that_raises_is_named_by_its_line_as_train_names_it(tmp_path):
    # The tune's fingerprint ran the factory bare: the command ended in the user's traceback, not this error.
    (tmp_path / "raising.py").write_text(
        "from torch import nn\nfrom redline import Task\n\n"
        "def bad():\n    return Task(model=lambda: nn.Linear(-1, 3), loss_fn=nn.functional.cross_entropy, "
        "train_data=[1, 2], batch_size=1, name='bad')\n"
    )
    with pytest.raises(TrainingError, match=r"task 'bad': building the model or reading the first item") as refused:
        tune_command(task=f"{tmp_path / 'raising.py'}:bad", devices="cpu", budget=5.0, planned_steps=None,
                     batch_size=None, steps=1, json_output=False)  # fmt: skip
    assert "raising.py" in str(refused.value)
