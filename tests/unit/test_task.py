"""Task validation, model building, fingerprints and loading tasks from spec strings."""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.errors import ConfigError, TaskSpecError
from redline.task import Task, load_task


def tiny_data(rows: int = 4) -> TensorDataset:
    return TensorDataset(torch.randn(rows, 2), torch.randn(rows, 1))


def tiny_task(**overrides: object) -> Task:
    fields: dict[str, object] = {
        "model": nn.Linear(2, 1),
        "loss_fn": nn.functional.mse_loss,
        "train_data": tiny_data(),
        "batch_size": 2,
    }
    fields.update(overrides)
    return Task(**fields)  # type: ignore[arg-type]


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model": 42}, "model="),
        ({"batch_size": 0}, "batch_size=0"),
        ({"batch_size": -3}, "batch_size=-3"),
        ({"batch_size": 2.5}, "batch_size=2.5"),
        ({"epochs": 0}, "epochs=0"),
        ({"loss_fn": "mse"}, "loss_fn="),
        ({"train_data": 7}, "train_data="),
    ],
)
def test_invalid_fields_raise_config_error_naming_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        tiny_task(**overrides)
    assert field in str(info.value)


def test_optimizer_instance_is_rejected_with_a_factory_hint() -> None:
    model = nn.Linear(2, 1)
    instance = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as info:
        tiny_task(model=model, optimizer=instance)
    message = str(info.value)
    assert "optimizer=" in message
    assert "SGD" in message
    assert "lambda params" in message


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="epochs"):
        tiny_task(epochs=0)


def test_valid_task_keeps_its_values_and_default_optimizer_builds_an_optimizer() -> None:
    task = tiny_task(epochs=3, name="tiny")
    assert (task.batch_size, task.epochs, task.name) == (2, 3, "tiny")
    model = task.build_model()
    assert isinstance(task.optimizer(model.parameters()), torch.optim.Optimizer)


# --- build_model --------------------------------------------------------------------------------


def test_build_model_returns_a_deep_copy_of_a_module() -> None:
    original = nn.Linear(2, 1)
    before = original.weight.detach().clone()
    task = tiny_task(model=original)

    copy = task.build_model()
    assert copy is not original
    assert torch.equal(copy.weight, original.weight)
    with torch.no_grad():
        copy.weight.add_(1.0)

    assert torch.equal(original.weight, before)
    assert task.build_model() is not copy


def test_build_model_calls_a_factory_each_time() -> None:
    calls: list[nn.Module] = []

    def factory() -> nn.Module:
        calls.append(nn.Linear(2, 1))
        return calls[-1]

    task = tiny_task(model=factory)
    first, second = task.build_model(), task.build_model()
    assert calls == [first, second]
    assert first is not second


def test_build_model_rejects_a_factory_that_returns_no_module() -> None:
    task = tiny_task(model=lambda: "not a module")
    with pytest.raises(ConfigError, match=r"model\(\)"):
        task.build_model()


# --- fingerprint --------------------------------------------------------------------------------


def test_fingerprint_is_stable_for_equal_tasks() -> None:
    data = tiny_data()
    a = tiny_task(model=nn.Linear(2, 1), train_data=data)
    b = tiny_task(model=nn.Linear(2, 1), train_data=data)
    assert a.fingerprint() == a.fingerprint()
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 16


def test_fingerprint_is_the_same_for_a_module_and_a_factory_of_it() -> None:
    data = tiny_data()
    assert tiny_task(model=nn.Linear(2, 1), train_data=data).fingerprint() == (
        tiny_task(model=lambda: nn.Linear(2, 1), train_data=data).fingerprint()
    )


@pytest.mark.parametrize(
    "change",
    [
        {"batch_size": 3},
        {"model": nn.Linear(2, 5)},
        {"model": nn.Sequential(nn.Linear(2, 1))},
        {"train_data": tiny_data(rows=5)},
    ],
)
def test_fingerprint_changes_with_batch_size_model_shape_or_data_size(change: dict[str, object]) -> None:
    data = tiny_data()
    base = tiny_task(model=nn.Linear(2, 1), train_data=data)
    changed = tiny_task(**{"model": nn.Linear(2, 1), "train_data": data, **change})
    assert base.fingerprint() != changed.fingerprint()


# --- load_task ----------------------------------------------------------------------------------

TASK_SOURCE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.task import Task


def make(batch_size=2, name="tiny"):
    data = TensorDataset(torch.randn(4, 2), torch.randn(4, 1))
    return Task(model=nn.Linear(2, 1), loss_fn=nn.functional.mse_loss, train_data=data,
                batch_size=batch_size, name=name)


def flexible(**options):
    return make(**options)


def broken():
    raise RuntimeError("disk on fire")


def not_a_task():
    return {"model": None}


def forwards_spec_error():
    from redline.errors import TaskSpecError
    raise TaskSpecError("explained by the factory")


NOT_CALLABLE = 3
"""


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_tasks.py"
    path.write_text(textwrap.dedent(TASK_SOURCE))
    return path


@pytest.fixture
def task_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Write a package with a tasks module on sys.path and return ``pkg.tasks``, unique per test."""
    package = f"redline_test_pkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "tasks.py").write_text(textwrap.dedent(TASK_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"{package}.tasks"
    for name in [n for n in sys.modules if n.startswith(package)]:
        del sys.modules[name]


def test_load_task_from_a_module_spec(task_module: str) -> None:
    task = load_task(f"{task_module}:make")
    assert isinstance(task, Task)
    assert (task.batch_size, task.name) == (2, "tiny")


def test_load_task_from_a_file_spec(task_file: Path) -> None:
    task = load_task(f"{task_file}:make")
    assert isinstance(task, Task)
    assert len(task.train_data) == 4  # type: ignore[arg-type]


@pytest.mark.parametrize("factory", ["make", "flexible"])
def test_load_task_passes_options_to_the_factory(task_file: Path, task_module: str, factory: str) -> None:
    from_file = load_task(f"{task_file}:{factory}", batch_size=3, name="big")
    from_module = load_task(f"{task_module}:{factory}", batch_size=3, name="big")
    for task in (from_file, from_module):
        assert (task.batch_size, task.name) == (3, "big")


def test_spec_without_colon_is_rejected_with_the_allowed_forms() -> None:
    with pytest.raises(TaskSpecError) as info:
        load_task("just_a_name")
    message = str(info.value)
    assert "just_a_name" in message
    assert "':'" in message
    assert "pkg.module:factory" in message


def test_unknown_example_lists_the_allowed_forms() -> None:
    with pytest.raises(TaskSpecError) as info:
        load_task("example:nope")
    message = str(info.value)
    assert "'nope'" in message
    assert "digits" in message
    assert "pkg.module:factory" in message
    assert "path/to/file.py:factory" in message


def test_missing_module_is_named() -> None:
    with pytest.raises(TaskSpecError) as info:
        load_task("redline_no_such_module_xyz.tasks:make")
    assert "redline_no_such_module_xyz" in str(info.value)
    assert "not found" in str(info.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "absent.py"
    with pytest.raises(TaskSpecError) as info:
        load_task(f"{missing}:make")
    assert "absent.py" in str(info.value)
    assert "does not exist" in str(info.value)


def test_file_that_fails_to_import_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "bad_tasks.py"
    path.write_text("raise RuntimeError('import boom')\n")
    with pytest.raises(TaskSpecError, match="import boom"):
        load_task(f"{path}:make")


def test_module_that_fails_to_import_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"redline_bad_tasks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("raise RuntimeError('import boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskSpecError, match="import boom"):
        load_task(f"{name}:make")


@pytest.mark.parametrize("name", ["missing_factory", "NOT_CALLABLE"])
def test_missing_factory_lists_the_callables_present(task_file: Path, task_module: str, name: str) -> None:
    for spec in (f"{task_file}:{name}", f"{task_module}:{name}"):
        with pytest.raises(TaskSpecError) as info:
            load_task(spec)
        message = str(info.value)
        assert repr(name) in message
        for present in ("make", "flexible", "broken", "not_a_task"):
            assert present in message


def test_unknown_option_names_it_and_the_accepted_ones(task_file: Path) -> None:
    with pytest.raises(TaskSpecError) as info:
        load_task(f"{task_file}:make", batch_size=3, colour="red")
    message = str(info.value)
    assert "colour" in message
    assert "batch_size" in message
    assert "name" in message


def test_factory_that_raises_is_reported_with_spec_and_exception(task_file: Path) -> None:
    spec = f"{task_file}:broken"
    with pytest.raises(TaskSpecError) as info:
        load_task(spec)
    message = str(info.value)
    assert spec in message
    assert "RuntimeError" in message
    assert "disk on fire" in message
    assert isinstance(info.value.__cause__, RuntimeError)


def test_task_spec_error_from_the_factory_passes_through_unchanged(task_file: Path) -> None:
    with pytest.raises(TaskSpecError) as info:
        load_task(f"{task_file}:forwards_spec_error")
    assert str(info.value) == "explained by the factory"


def test_factory_that_returns_no_task_is_rejected(task_module: str) -> None:
    with pytest.raises(TaskSpecError) as info:
        load_task(f"{task_module}:not_a_task")
    assert "dict" in str(info.value)
    assert "Task" in str(info.value)


def test_task_module_missing_a_dependency_names_the_dependency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"redline_dep_tasks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("import redline_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskSpecError, match=r"(?s)redline_no_such_dependency.*not installed"):
        load_task(f"{name}:factory")


def test_bool_is_not_a_batch_size() -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        Task(
            model=nn.Linear(2, 1),
            loss_fn=nn.functional.mse_loss,
            train_data=TensorDataset(torch.ones(2, 2)),
            batch_size=True,
        )


# --- module specs from the working directory ----------------------------------------------------


def write_package(folder: Path, package: str, name: str) -> None:
    (folder / package).mkdir(parents=True)
    (folder / package / "__init__.py").write_text("")
    (folder / package / "tasks.py").write_text(textwrap.dedent(TASK_SOURCE).replace('name="tiny"', f"name={name!r}"))


@pytest.fixture
def package_name() -> Iterator[str]:
    package = f"redline_cwd_pkg_{uuid.uuid4().hex[:8]}"
    yield package
    for name in [n for n in sys.modules if n.startswith(package)]:
        del sys.modules[name]


def test_module_spec_is_found_in_the_working_directory_searched_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package_name: str
) -> None:
    write_package(tmp_path, package_name, "from cwd")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry])  # as under the console script
    assert load_task(f"{package_name}.tasks:make").name == "from cwd"
    assert sys.path[-1] == str(tmp_path)
    load_task(f"{package_name}.tasks:make")
    assert sys.path.count(str(tmp_path)) == 1


def test_an_installed_package_wins_over_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package_name: str
) -> None:
    write_package(tmp_path / "site", package_name, "installed")
    write_package(tmp_path / "work", package_name, "from cwd")
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.chdir(tmp_path / "work")
    assert load_task(f"{package_name}.tasks:make").name == "installed"


def test_missing_module_hints_at_the_working_directory() -> None:
    with pytest.raises(TaskSpecError) as info:
        load_task("redline_no_such_pkg_xyz.tasks:make")
    assert "\nhint: run redline in the folder that holds redline_no_such_pkg_xyz/" in str(info.value)
