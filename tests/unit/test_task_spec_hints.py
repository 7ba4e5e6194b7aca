"""A task spec that imports the way only another spec form allows is told that form, and the form it names works."""

from __future__ import annotations

import re
import uuid

import numpy as np
import pytest
from typer.testing import CliRunner

from redline.cli.main import app
from redline.errors import TaskSpecError
from redline.task import Task, load_task

NET = "from torch import nn\n\n\ndef net():\n    return nn.Linear(2, 1)\n"
MAKE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline


def make():
    data = TensorDataset(torch.randn(4, 2), torch.randn(4, 1))
    return redline.Task(model={model}, loss_fn=nn.functional.mse_loss, train_data=data, batch_size=2)
"""


def unique(prefix: str) -> str:
    """A module name no other test has imported: Python keeps a module once imported, by its name."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("run_in", ["the package's folder", "another folder"])
def test_a_package_file_that_imports_relatively_is_told_its_module_spec(tmp_path, monkeypatch, run_in):
    """`--task mypkg/tasks.py:make` whose tasks.py does `from .models import net` was told "the error is in the
    task's own code", where the module spec mypkg.tasks:make loads it."""
    package = unique("redline_pkg")
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "models.py").write_text(NET)
    (tmp_path / package / "tasks.py").write_text("from .models import net\n" + MAKE.format(model="net"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path if run_in == "the package's folder" else tmp_path / "elsewhere")
    with pytest.raises(TaskSpecError) as refused:
        load_task(f"{tmp_path / package / 'tasks.py'}:make")
    message = str(refused.value)
    assert "the error is in the task's own code" not in message
    run = "" if run_in == "the package's folder" else f", with redline run in {str(tmp_path)!r}"
    assert message.endswith(f"\nhint: tasks.py is a module of the package {package!r}: name it as one, "
                            f"'{package}.tasks:make'{run}"), message  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert isinstance(load_task(f"{package}.tasks:make"), Task)


def test_a_file_in_no_package_that_imports_relatively_is_told_to_import_absolutely(tmp_path):
    (tmp_path / "tasks.py").write_text("from .models import net\n")
    with pytest.raises(TaskSpecError, match=r"\nhint: tasks\.py is in no package \(no __init__\.py beside it\): "):
        load_task(f"{tmp_path / 'tasks.py'}:make")


def test_a_module_spec_whose_module_imports_one_beside_it_is_told_the_file_spec(tmp_path, monkeypatch):
    """From the parent folder, `--task proj.tasks:make` where tasks.py does `from models import MLP` (models.py beside
    it) was told to pip install 'models'; the file spec proj/tasks.py:make finds it."""
    folder, models = unique("redline_proj"), unique("redline_models")
    (tmp_path / folder).mkdir()
    (tmp_path / folder / f"{models}.py").write_text(
        "from torch import nn\n\n\ndef net():\n    return nn.Linear(2, 1)\n"
    )
    (tmp_path / folder / "tasks.py").write_text(f"from {models} import net\n" + MAKE.format(model="net"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TaskSpecError) as refused:
        load_task(f"{folder}.tasks:make")
    message = str(refused.value)
    assert "pip install" not in message
    assert message.endswith(f"\nhint: {models}.py lies beside tasks.py, whose folder is searched first only for a "
                            f"file given by its path: give the file, '{folder}/tasks.py:make'"), message  # fmt: skip
    assert isinstance(load_task(f"{folder}/tasks.py:make"), Task)


def test_a_factory_named_with_a_dot_is_told_the_spec_with_a_colon(tmp_path, monkeypatch):
    """`--task tasks.make` was told 'tasks.make:make_task', where tasks.py defines make."""
    module = unique("redline_tasks")
    (tmp_path / f"{module}.py").write_text(MAKE.format(model="nn.Linear(2, 1)"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TaskSpecError) as refused:
        load_task(f"{module}.make")
    assert str(refused.value).endswith(f"\nhint: did you mean '{module}:make'?"), str(refused.value)
    assert isinstance(load_task(f"{module}:make"), Task)


@pytest.mark.parametrize("spec", ["..make", "...x", ".make", "a..make"])
def test_a_spec_of_dots_without_a_colon_is_told_it_has_none(spec, tmp_path, monkeypatch):
    """`--task ..make` ended in a traceback, ValueError: PosixPath('.') has an empty name, from the look for the
    module file that `tasks.make` means."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TaskSpecError, match=rf"^task spec '{re.escape(spec)}' has no ':'; expected 'example:NAME'"):
        load_task(spec)


@pytest.mark.parametrize("command", ["train", "train with a task-arg", "predict"])
def test_the_commands_refuse_a_spec_of_dots_with_the_spec_error(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "in.npy", np.zeros((2, 64), dtype=np.float32))
    args = {
        "train": ["train", "--task", "..make", "--max-steps", "1"],
        "train with a task-arg": ["train", "--task", "..make", "--task-arg", "n=1"],
        "predict": ["predict", "..make", "--input", "in.npy", "--output", "out.npy"],
    }[command]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, TaskSpecError), result.exception  # main() says it without a traceback
    assert "spec '..make' has no ':'" in str(result.exception)


@pytest.mark.parametrize("spec", ["~nosuchuser.make", "~nosuchuser/tasks.py:make", "~nosuchuser"])
def test_a_path_under_an_unknown_users_home_is_an_error_of_the_spec_not_a_traceback(spec):
    # Path.expanduser raises RuntimeError("Could not determine home directory.") for ~nosuchuser; the shell leaves it
    with pytest.raises(TaskSpecError, match=re.escape(f"task spec '{spec}'")):
        load_task(spec)


def test_an_out_dir_under_an_unknown_users_home_stays_as_given(tmp_path, monkeypatch):
    from pathlib import Path

    from redline.cli.options import given_file
    from redline.train.config import TrainerConfig

    monkeypatch.chdir(tmp_path)
    assert TrainerConfig(out_dir="~nosuchuser/run").out_dir == Path("~nosuchuser/run"), "as the shell leaves it"
    assert given_file("x.json")("~nosuchuser/x.json") == Path("~nosuchuser/x.json")


def test_a_name_that_is_neither_a_task_nor_its_factory_is_said_to_be_of_its_type(tmp_path):
    # It said the file "has no callable 'SIZE'", though SIZE was there: a number, not a factory.
    spec = tmp_path / "sized.py"
    spec.write_text(MAKE.format(model="nn.Linear(2, 1)") + "\nSIZE = 5\n")
    with pytest.raises(TaskSpecError) as refused:
        load_task(f"{spec}:SIZE")
    message = str(refused.value)
    assert f"{spec} defines 'SIZE' as a value of type int, not a Task or its factory; defined there: make" in message
    assert message.endswith("hint: name a function that returns a Task, or a Task")
