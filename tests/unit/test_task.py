"""Task validation, model building, fingerprints and loading tasks from spec strings."""

from __future__ import annotations

import functools
import re
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from redline.errors import ConfigError, RedlineError, TaskSpecError
from redline.runtime.optimizer import build_optimizer
from redline.task import Task, call_factory, load_task


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


class Stream(IterableDataset):  # type: ignore[type-arg]
    """A stream of (inputs, targets) without a length: allowed as data."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield torch.randn(2), torch.randn(1)


EMPTY = TensorDataset(torch.empty(0, 2), torch.empty(0, 1))


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"train_data": EMPTY}, "len(train_data)=0 is not allowed; expected at least one item\nhint: check how"),
        ({"val_data": EMPTY}, "len(val_data)=0 is not allowed"),
        ({"train_data": []}, "len(train_data)=0"),
        ({"train_data": DataLoader(tiny_data())}, "train_data=<DataLoader> is not allowed; expected a torch Dataset"),
        ({"val_data": DataLoader(tiny_data())}, "hint: pass the loader's dataset (val_data=loader.dataset)"),
        ({"train_data": torch.randn(4, 2)}, "train_data=<Tensor> is not allowed"),
        ({"train_data": np.zeros((4, 2))}, "hint: pair the inputs with their targets: torch.utils.data.TensorDataset"),
        # the tensors themselves: trained, it warned "holds 2 items", then failed "stack expects each tensor ..."
        (
            {"train_data": (torch.randn(4, 2), torch.randn(4, 1))},
            "train_data=<tuple of 2 Tensors> is not allowed; expected a torch Dataset of (inputs, targets) items\n"
            "hint: pair the inputs with their targets: torch.utils.data.TensorDataset(inputs, targets)",
        ),
        ({"val_data": [np.zeros((4, 2)), np.zeros(4)]}, "val_data=<list of 2 ndarrays> is not allowed"),
        ({"train_data": "data/train.csv"}, "train_data='data/train.csv' is not allowed"),
        ({"train_data": Path("train.pt")}, "hint: load the file into a Dataset first"),
        ({"train_data": {"train": tiny_data()}}, "hint: pass one split, e.g. train_data=splits['train']"),
        # Hugging Face's columns (dataset.to_dict()): not splits to choose from, but one dataset to pair up
        (
            {"train_data": {"x": [[0.0, 1.0]] * 4, "y": [[0.0]] * 4}},
            "train_data=<dict> is not allowed; expected a torch Dataset of (inputs, targets) items\nhint: its values "
            "are columns of one length: pair them in a Dataset, e.g. train_data=torch.utils.data.TensorDataset("
            "torch.tensor(columns['x']), torch.tensor(columns['y']))",
        ),
        ({"train_data": iter(tiny_data())}, "hint: an iterator is used up after one pass"),
        ({"train_data": {1, 2}}, "hint: give it __getitem__ and __len__"),
        ({"val_data": 3}, "val_data=3 is not allowed; expected a torch Dataset of (inputs, targets) items"),
        (
            {"loss_fn": nn.MSELoss},
            "loss_fn=<MSELoss> is not allowed; expected a callable (outputs, targets) -> "
            "scalar tensor, not a class\nhint: pass an instance: MSELoss()",
        ),
        (
            {"scheduler": "cosine"},
            "scheduler='cosine' is not allowed; expected a callable optimizer -> LR scheduler, "
            "or None\nhint: pass the function itself: scheduler=lambda opt:",
        ),
        ({"metric": "accuracy"}, "metric='accuracy' is not allowed; expected a callable (outputs, targets) -> float"),
        ({"sample": 3}, "sample=3 is not allowed; expected a callable model -> str, or None"),
        ({"name": ""}, "name='' is not allowed; expected a non-empty string\nhint: e.g. name=\"digits\""),
        ({"name": 7}, "name=7 is not allowed"),
        ({"optimizer": 1e-3}, "optimizer=0.001 is not allowed; expected a factory params -> Optimizer"),
    ],
)
def test_each_malformed_field_says_what_was_passed_what_is_expected_and_the_fix(
    overrides: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        tiny_task(**overrides)
    assert says in str(info.value)


def test_a_list_of_tensors_is_data_where_the_collate_fn_makes_the_pairs() -> None:
    sequences = [torch.arange(6), torch.arange(4)]  # token ids: the next token is each one's target

    def shifted(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        shortest = min(len(ids) for ids in items)
        batch = torch.stack([ids[:shortest] for ids in items])
        return batch[:, :-1], batch[:, 1:]

    assert tiny_task(train_data=sequences, collate_fn=shifted).train_data is sequences


def test_a_scheduler_built_already_is_refused() -> None:
    model = nn.Linear(2, 1)
    built = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    with pytest.raises(ConfigError, match=r"scheduler=<StepLR> is not allowed.*\nhint: pass the function itself"):
        tiny_task(model=model, scheduler=built)


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


def test_a_model_class_that_needs_arguments_is_refused_when_the_task_is_made() -> None:
    # model=nn.Linear would fail only when a tool first builds it, with a TypeError from redline's own line.
    with pytest.raises(ConfigError, match=r"model=<Linear> is not allowed") as caught:
        tiny_task(model=nn.Linear)
    message = str(caught.value)
    assert "Linear needs in_features, out_features" in message
    assert "hint: pass an instance, model=Linear(...), or a factory that fills them in" in message

    def make(*, width: int) -> nn.Module:
        return nn.Linear(width, 1)

    with pytest.raises(ConfigError, match=r"\(make needs width\)"):
        tiny_task(model=make)
    # a factory with defaults, a partial that fills the arguments in, *args: each called without arguments
    for fine in (lambda width=2: nn.Linear(width, 1), functools.partial(nn.Linear, 2, 1), lambda *a: nn.Linear(2, 1)):
        assert isinstance(tiny_task(model=fine).build_model(), nn.Linear)


class OneInput(nn.Module):
    def forward(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs.mean()


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("scheduler", torch.optim.lr_scheduler.StepLR, "StepLR cannot be called with 1 argument (missing a required"),
        ("loss_fn", lambda outputs: outputs.sum(), "<lambda> cannot be called with 2 arguments (too many positional"),
        ("metric", lambda outputs, targets, k: 1.0, "<lambda> cannot be called with 2 arguments (missing a required"),
        ("collate_fn", lambda: None, "<lambda> cannot be called with 1 argument"),
        ("sample", lambda model, prompt: "", "<lambda> cannot be called with 1 argument"),
        ("optimizer", lambda params, lr: torch.optim.SGD(params, lr), "<lambda> cannot be called with 1 argument"),
        # a module, read by its forward: nn.Module.__call__ takes anything, and the step failed with a hint of shapes
        ("loss_fn", OneInput(), "OneInput cannot be called with 2 arguments (too many positional"),
        ("metric", OneInput(), "OneInput cannot be called with 2 arguments (too many positional"),
    ],
)
def test_a_function_that_cannot_take_what_a_run_passes_it_is_refused(field: str, value: object, says: str) -> None:
    # Called later by a run, its TypeError would come from redline's line and be shown as redline's bug.
    with pytest.raises(ConfigError, match=rf"^{field}=<\w+> is not allowed") as caught:
        tiny_task(**{field: value})
    assert f"\nhint: {says}" in str(caught.value)


def test_functions_that_take_what_a_run_passes_them_are_kept() -> None:
    task = tiny_task(
        loss_fn=nn.MSELoss(),
        optimizer=torch.optim.SGD,  # the class: SGD(params) with its default lr
        scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10),
        metric=lambda outputs, targets, *, scale=1.0: scale,
        sample=lambda *args: "",
        collate_fn=print,  # a builtin: no signature to read, so it is called as given
    )
    assert isinstance(task.loss_fn, nn.MSELoss)


def test_build_model_rejects_a_factory_that_returns_no_module() -> None:
    # It said "model()='str' is not allowed", a type name quoted as if it were the value, and no hint.
    task = tiny_task(model=lambda: "not a module")
    with pytest.raises(ConfigError) as refused:
        task.build_model()
    assert str(refused.value) == (
        "the model factory returned 'not a module', not an nn.Module\nhint: return the module it builds "
        "(model=lambda: MyNet(...)), or pass the module itself as model="
    )
    for returned, said in [
        (None, "returned None, not an nn.Module\nhint: the factory returns nothing: end it with `return model`"),
        (nn.Linear, "returned the class Linear, not an nn.Module\nhint: it returned the class: return an instance"),
        ((1, 2), "returned a tuple, not an nn.Module"),
    ]:
        with pytest.raises(ConfigError) as refused:
            tiny_task(model=lambda returned=returned: returned).build_model()
        assert said in str(refused.value)
    with pytest.raises(ConfigError) as again:
        build_optimizer(lambda params: "sgd", nn.Linear(2, 1))
    assert str(again.value).startswith("the optimizer factory returned str 'sgd', not a torch.optim.Optimizer\nhint:")


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


def test_a_factorys_model_is_fingerprinted_without_weights_unless_it_cannot_be_built_on_meta() -> None:
    """The fingerprint reads shapes, not values: a factory builds on the meta device, so a large model costs no
    memory for it, its moves to a device kept there; one that cannot (it reads a weight's value) is built for real,
    and all give the fingerprint of the module itself."""
    data, built_on = tiny_data(), []

    def factory() -> nn.Module:
        model = nn.Linear(2, 1)
        built_on.append(model.weight.device.type)
        return model

    def moving() -> nn.Module:
        return factory().to("cpu")

    def reading() -> nn.Module:
        model = factory()
        assert float(model.weight.abs().sum()) >= 0  # a value: none on meta
        return model

    own = tiny_task(model=nn.Linear(2, 1), train_data=data).fingerprint()
    assert tiny_task(model=factory, train_data=data).fingerprint() == own and built_on == ["meta"]
    assert tiny_task(model=moving, train_data=data).fingerprint() == own and built_on[1:] == ["meta"]
    assert tiny_task(model=reading, train_data=data).fingerprint() == own and built_on[2:] == ["meta", "cpu"]


@pytest.mark.parametrize(
    "change",
    [
        {"model": nn.Linear(2, 5)},
        {"model": nn.Sequential(nn.Linear(2, 1))},
        {"train_data": tiny_data(rows=5)},
    ],
)
def test_fingerprint_changes_with_model_shape_or_data_size(change: dict[str, object]) -> None:
    data = tiny_data()
    base = tiny_task(model=nn.Linear(2, 1), train_data=data)
    changed = tiny_task(**{"model": nn.Linear(2, 1), "train_data": data, **change})
    assert base.fingerprint() != changed.fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {"loss_fn": nn.functional.mse_loss},
        {"loss_fn": nn.L1Loss()},
        {"optimizer": lambda params: torch.optim.SGD(params, lr=0.1)},
        {"optimizer": lambda params: torch.optim.AdamW(params, lr=1e-3, amsgrad=True)},
        {"optimizer": lambda params: torch.optim.AdamW([{"params": list(params)[:1]}], lr=1e-3)},
    ],
)
def test_fingerprint_changes_with_the_loss_or_the_optimizer(change: dict[str, object]) -> None:
    """Another loss or optimizer times differently (and judges a candidate's loss differently): no cached trial."""
    data = tiny_data()
    base = tiny_task(model=nn.Linear(2, 1), train_data=data, loss_fn=nn.functional.l1_loss)
    changed = tiny_task(**{"model": nn.Linear(2, 1), "train_data": data, "loss_fn": nn.functional.l1_loss, **change})
    assert base.fingerprint() != changed.fingerprint()


def test_fingerprint_changes_when_part_of_the_model_is_frozen() -> None:
    """A linear probe (its body frozen) has little of a full fine-tuning's backward: one's tune is not the other's."""
    data = tiny_data()

    def probe() -> nn.Module:
        model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1))
        model[0].requires_grad_(False)
        return model

    whole = tiny_task(model=lambda: nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1)), train_data=data).fingerprint()
    frozen = tiny_task(model=probe, train_data=data).fingerprint()
    assert frozen != whole and tiny_task(model=probe(), train_data=data).fingerprint() == frozen


def test_fingerprint_is_the_same_for_another_learning_rate() -> None:
    """A sweep over the learning rate or weight decay is one workload: it pays for one trial, not one each."""
    data = tiny_data()
    fingerprints = {
        tiny_task(
            model=nn.Linear(2, 1), train_data=data, optimizer=lambda params, lr=lr: torch.optim.AdamW(params, lr=lr)
        ).fingerprint()
        for lr in (1e-3, 3e-4)
    }
    assert len(fingerprints) == 1


def test_fingerprint_changes_with_the_shape_of_the_samples() -> None:
    """A model that takes any image size times differently on larger images: a cached trial must not carry over."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    small = TensorDataset(torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    large = TensorDataset(torch.randn(4, 1, 64, 64), torch.zeros(4, dtype=torch.long))
    fingerprint = tiny_task(model=model, train_data=small).fingerprint()
    assert fingerprint != tiny_task(model=model, train_data=large).fingerprint()
    # The values of the samples do not change the workload: new random data of the same shape matches.
    again = TensorDataset(torch.randn(4, 1, 8, 8), torch.ones(4, dtype=torch.long))
    assert fingerprint == tiny_task(model=model, train_data=again).fingerprint()


class SizedStream(IterableDataset):  # type: ignore[type-arg]
    """A stream that knows its length, as many do: it has no items by index."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter([(torch.zeros(2), torch.zeros(1))] * 4)

    def __len__(self) -> int:
        return 4


def test_fingerprint_of_a_stream_with_a_length_reads_no_item_by_index() -> None:
    assert len(tiny_task(train_data=SizedStream()).fingerprint()) == 16


# --- load_task ----------------------------------------------------------------------------------

TASK_SOURCE = """
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from redline.task import Task


def make(batch_size=2, name="tiny"):
    data = TensorDataset(torch.randn(4, 2), torch.randn(4, 1))
    return Task(model=nn.Linear(2, 1), loss_fn=nn.functional.mse_loss, train_data=data,
                batch_size=batch_size, name=name)


def flexible(**options):
    return make(**options)


def broken():
    raise RuntimeError("disk on fire")


def needs_width(width, depth=2):
    return make()


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


def test_a_missing_factory_lists_what_the_file_defines_and_how_many_more(tmp_path: Path) -> None:
    # the list was cut at 12 names without a word
    (tmp_path / "many.py").write_text("".join(f"def f{i:02d}():\n    pass\n" for i in range(16)))
    with pytest.raises(TaskSpecError, match=r"defined there: f00, f01, .*, f11 and 4 more\n"):
        load_task(f"{tmp_path / 'many.py'}:nope")


def test_an_example_spec_with_a_second_colon_names_the_example_meant() -> None:
    # it said "module 'example:digits' not found ... run redline in the folder that holds example:digits/"
    with pytest.raises(
        TaskSpecError, match=r"'example:digits:extra' has more than one ':'.*\nhint: did you mean 'example:digits'\?$"
    ):
        load_task("example:digits:extra")


@pytest.mark.parametrize(
    ("spec", "meant"),
    [("tasks/good.py:make:x", "tasks/good.py:make"), ("pkg.tasks:make:x", "pkg.tasks:make"),
     ("C:\\tasks.py:make:x", "C:\\tasks.py:make")],
)  # fmt: skip
def test_a_spec_with_a_second_colon_is_refused_naming_the_factory_meant(spec: str, meant: str) -> None:
    # it said "file 'tasks/good.py:make' does not exist ... did you mean 'tasks/good.py:x'"
    with pytest.raises(TaskSpecError) as info:
        load_task(spec)
    assert str(info.value).startswith(f"task spec {spec!r} has more than one ':'; expected ")
    assert str(info.value).endswith(f"\nhint: did you mean '{meant}'?")


TINY_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline

def make():
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    return redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=4, name="tiny")
"""


def test_a_file_in_a_folder_with_a_colon_in_its_name_loads(tmp_path: Path) -> None:
    # a timestamped run folder (run:1, 2026-12-06T16:36): it was refused as a spec with two ':'
    folder = tmp_path / "run:1"
    folder.mkdir()
    (folder / "tasks.py").write_text(TINY_TASK)
    assert load_task(f"{folder / 'tasks.py'}:make").name == "tiny"
    with pytest.raises(TaskSpecError) as info:  # a second ':' after the file is still refused as such
        load_task(f"{folder / 'tasks.py'}:make:x")
    assert str(info.value).endswith(f"\nhint: did you mean '{folder / 'tasks.py'}:make'?")


def test_a_missing_file_in_a_folder_with_a_colon_in_its_name_is_said_missing(tmp_path: Path) -> None:
    spec = f"{tmp_path / 'run:1' / 'tasks.py'}:make"
    with pytest.raises(TaskSpecError, match=r"tasks\.py' does not exist"):
        load_task(spec)


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
    hint = f"\nhint: a relative path is read from {Path.cwd()}; `example:digits` names a built-in task"
    assert hint in str(info.value)
    (tmp_path / "tasks.py").write_text("def make(): pass\n")
    with pytest.raises(TaskSpecError, match=r"\nhint: did you mean '.*tasks\.py:make'\?"):
        load_task(f"{tmp_path / 'taks.py'}:make")  # one letter off the file beside it


def test_file_that_fails_to_import_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "bad_tasks.py"
    path.write_text("raise RuntimeError('import boom')\n")
    with pytest.raises(TaskSpecError, match="import boom"):
        load_task(f"{path}:make")


FACTORY_BUGS = {  # a task file's source -> the line the error must show
    "import redline\n\ndef make():\n    return helper()\n": r"at .*tasks\.py:4 in make: return helper\(\)",
    "import redline\nlimit = 10 / 0\n": r"at .*tasks\.py:2 in <module>: limit = 10 / 0",
    "def make(:\n    pass\n": r"at .*tasks\.py:1: def make\(:",
}


@pytest.mark.parametrize("source", FACTORY_BUGS)
def test_a_bug_in_a_task_file_is_shown_at_its_line(tmp_path: Path, source: str) -> None:
    path = tmp_path / "tasks.py"
    path.write_text(source)
    with pytest.raises(TaskSpecError, match=f"(?s){FACTORY_BUGS[source]}\nhint: the error is in the task's own code"):
        load_task(f"{path}:make")


def test_module_that_fails_to_import_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"redline_bad_tasks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("raise RuntimeError('import boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskSpecError, match="import boom"):
        load_task(f"{name}:make")


def test_a_task_file_that_does_not_parse_is_said_as_python_says_it_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "syn.py").write_text("def make(:\n    pass\n")
    with pytest.raises(TaskSpecError) as raised:
        load_task(f"{tmp_path / 'syn.py'}:make")
    said = str(raised.value)  # it was the repr of the error's arguments: SyntaxError('invalid syntax', ('/tmp/...
    assert f"importing {str(tmp_path / 'syn.py')!r} raised SyntaxError: invalid syntax (syn.py, line 1)\n" in said
    assert f"\n  at {tmp_path / 'syn.py'}:1: def make(:\n" in said


SCRIPT_THAT_EXITS = """
import argparse
argparse.ArgumentParser().parse_args(["--not-an-option"])  # a training script's top level, run on import
"""


def test_a_script_that_exits_on_import_is_reported_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT_THAT_EXITS)
    name = f"redline_exiting_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(SCRIPT_THAT_EXITS)
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in (f"{path}:make", f"{name}:make"):
        with pytest.raises(TaskSpecError, match="exited") as info:
            load_task(spec)
        assert "if __name__ == '__main__':" in str(info.value)


@pytest.mark.parametrize("name", ["missing_factory", "NOT_CALLABLE"])
def test_missing_factory_lists_the_callables_present(task_file: Path, task_module: str, name: str) -> None:
    for spec in (f"{task_file}:{name}", f"{task_module}:{name}"):
        with pytest.raises(TaskSpecError) as info:
            load_task(spec)
        message = str(info.value)
        assert repr(name) in message
        for present in ("make", "flexible", "broken", "not_a_task"):
            assert present in message


def test_a_mistyped_factory_names_the_nearest_and_not_what_the_file_imported(task_file: Path) -> None:
    with pytest.raises(TaskSpecError) as info:
        load_task(f"{task_file}:flexibel")
    message = str(info.value)
    assert f"hint: did you mean '{task_file}:flexible'?" in message
    assert "TensorDataset" not in message and "Task," not in message  # imported there, not defined there


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
    assert f"at {task_file}:" in message and 'in broken: raise RuntimeError("disk on fire")' in message  # its line
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


@pytest.mark.parametrize(
    ("made", "says"),
    [
        (nn.Linear(2, 1), "hint: a model alone cannot be trained or timed: return redline.Task(model=..., loss_fn="),
        (None, "hint: the factory returns nothing: end it with return redline.Task(model=..., loss_fn=..."),
        ({"model": None}, "hint: return redline.Task(model=..., loss_fn=..., train_data=..., batch_size=...)"),
    ],
)
def test_factory_that_returns_a_model_or_nothing_says_how_to_return_a_task(made: object, says: str) -> None:
    with pytest.raises(TaskSpecError) as info:
        call_factory("tasks.py:make", lambda: made, {})
    message = str(info.value)
    assert f"the factory returned {type(made).__name__}, expected a redline.Task\n" in message
    assert says in message


def test_a_working_directory_module_shadowed_by_the_standard_librarys_says_to_give_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # colorsys.py of the user's: the dotted spec imports the standard library's colorsys, which has no make().
    (tmp_path / "colorsys.py").write_text(textwrap.dedent(TASK_SOURCE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the working directory the spec adds goes with the test
    with pytest.raises(TaskSpecError) as info:
        load_task("colorsys:make")
    message = str(info.value)
    assert "hint: the installed 'colorsys' (" in message
    assert "before colorsys.py of the working directory: give the file, 'colorsys.py:make', or rename it" in message
    assert isinstance(load_task("colorsys.py:make"), Task)  # the spec the hint gives loads the user's file


def test_a_spec_with_a_stray_space_or_no_factory_says_the_spec_meant(task_file: Path) -> None:
    meant = re.escape(f"{task_file}:make")
    for spec in (f"{task_file}: make", f"{task_file}:make "):
        with pytest.raises(TaskSpecError, match=rf"is malformed.*\nhint: did you mean '{meant}'\?"):
            load_task(spec)
    with pytest.raises(TaskSpecError, match=r"is malformed.*\nhint: name the function that returns the Task"):
        load_task(f"{task_file}:")  # the factory left out: the file's functions are named


def test_a_folder_given_as_the_file_names_the_python_files_in_it(task_file: Path) -> None:
    with pytest.raises(TaskSpecError) as info:
        load_task(f"{task_file.parent}:make")
    message = str(info.value)
    assert f"folder {str(task_file.parent)!r} is not a Python file" in message  # not "does not exist": it does
    assert f"hint: name the file in it, one of: '{task_file}:make'" in message


def test_task_module_missing_a_dependency_names_the_dependency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"redline_dep_tasks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("import redline_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskSpecError, match=r"(?s)redline_no_such_dependency.*not installed"):
        load_task(f"{name}:factory")


def test_task_file_missing_a_dependency_names_the_dependency(tmp_path: Path) -> None:
    # as a module spec does: the package to install, not "the error is in the task's own code"
    (tmp_path / "tasks.py").write_text("import redline_no_such_dependency\n")
    with pytest.raises(TaskSpecError) as info:
        load_task(f"{tmp_path / 'tasks.py'}:factory")
    assert "it imports 'redline_no_such_dependency', which is not installed" in str(info.value)
    assert "hint: pip install the package that provides 'redline_no_such_dependency'" in str(info.value)


def test_task_file_importing_a_misspelt_submodule_shows_its_line_not_an_install_hint(tmp_path: Path) -> None:
    # torch is installed: torch.nn.functionals is the file's typo, not a package to pip install
    (tmp_path / "tasks.py").write_text("import torch\nimport torch.nn.functionals as F\n")
    with pytest.raises(TaskSpecError) as info:
        load_task(f"{tmp_path / 'tasks.py'}:factory")
    message = str(info.value)
    assert "pip install" not in message and "import torch.nn.functionals as F" in message
    assert "hint: the error is in the task's own code" in message


@pytest.mark.parametrize("verb", ["Trainer", "estimate_memory", "find_batch_size"])
def test_a_verb_given_a_spec_or_a_model_instead_of_a_task_says_how_to_make_one(verb: str) -> None:
    import redline

    with pytest.raises(ConfigError, match=r"(?s)task='example:digits' .*hint: load it first: redline.load_task\("):
        getattr(redline, verb)("example:digits")
    with pytest.raises(ConfigError, match=r"(?s)task='Linear' is not allowed; expected a redline.Task.*hint:"):
        getattr(redline, verb)(nn.Linear(2, 1))


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


def test_a_module_missing_from_a_folder_here_is_said_so_with_the_nearest_name(tmp_path, monkeypatch) -> None:
    """Run from the folder that holds tasks/, the hint said to run redline in the folder that holds tasks/."""
    folder = f"redline_tasks_{uuid.uuid4().hex[:8]}"
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "mlp.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for asked, hint in ((f"{folder}.mpl", f"did you mean '{folder}.mlp:make'?"), (f"{folder}.gone", "")):
        with pytest.raises(TaskSpecError) as info:
            load_task(f"{asked}:make")
        said = str(info.value)
        assert f"\nhint: {folder}/ is here, but holds no {asked.rpartition('.')[2]}.py" in said
        assert said.endswith(hint) and "run redline in the folder" not in said


# --- every malformed field, in any combination ---------------------------------------------------

_MODEL = nn.Linear(2, 1)
MALFORMED: dict[str, list[object]] = {
    "model": [42, "resnet18", None, [nn.Linear(2, 1)], torch.zeros(2)],
    "loss_fn": ["mse", 0.5, None, nn.MSELoss, torch.tensor(1.0)],
    "train_data": [7, None, "train.csv", Path("train.pt"), torch.randn(4, 2), EMPTY, [], DataLoader(tiny_data()),
                   {"train": tiny_data()}, iter(tiny_data()), {1, 2}, object()],
    "val_data": [7, "val.csv", torch.randn(4, 2), EMPTY, DataLoader(tiny_data()), {"val": tiny_data()}],
    "optimizer": [torch.optim.SGD(_MODEL.parameters(), lr=0.1), "adam", 1e-3, None],
    "batch_size": [0, -1, 2.5, "64", True, None],
    "scheduler": ["cosine", 3, torch.optim.lr_scheduler.StepLR(torch.optim.SGD(_MODEL.parameters(), lr=0.1), 1)],
    "metric": ["accuracy", 0.5, nn.L1Loss],
    "sample": ["hello", 3],
    "epochs": [0, -2, 1.5, "3", True, None],
    "name": ["", "  ", 3, None, b"task"],
}  # fmt: skip


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_any_malformed_fields_are_refused_naming_one_of_them_and_the_fix(data: st.DataObject) -> None:
    fields = data.draw(st.lists(st.sampled_from(sorted(MALFORMED)), min_size=1, unique=True), label="fields")
    bad = {field: data.draw(st.sampled_from(MALFORMED[field]), label=field) for field in fields}
    with pytest.raises(RedlineError) as info:
        tiny_task(**bad)
    message = str(info.value)
    named = re.match(r"(?:len\()?(\w+)\)?=", message)
    assert named is not None and named.group(1) in fields, message
    assert " is not allowed; expected " in message
    assert "\nhint: " in message, message


VALID: dict[str, list[object]] = {
    "model": [nn.Linear(2, 1), lambda: nn.Linear(2, 1), nn.Sequential(nn.Linear(2, 1))],
    "loss_fn": [nn.functional.mse_loss, nn.MSELoss()],
    "train_data": [tiny_data(), [(torch.randn(2), torch.randn(1))] * 3, Stream()],
    "val_data": [None, tiny_data(), Stream()],
    "optimizer": [lambda params: torch.optim.SGD(params, lr=0.1), torch.optim.AdamW],
    "batch_size": [1, 64],
    "scheduler": [None, lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1)],
    "metric": [None, lambda outputs, targets: 0.0],
    "sample": [None, lambda model: "text"],
    "epochs": [1, 3],
    "name": ["tiny", "digits v2"],
}


@settings(max_examples=50, deadline=None)
@given(st.fixed_dictionaries({field: st.sampled_from(values) for field, values in VALID.items()}))
def test_any_well_formed_fields_build_a_task_that_keeps_them(fields: dict[str, object]) -> None:
    task = Task(**fields)  # type: ignore[arg-type]
    assert all(getattr(task, field) is value for field, value in fields.items())


def test_a_factory_option_without_a_default_is_asked_for_by_its_flag(task_file: Path) -> None:
    with pytest.raises(TaskSpecError) as info:
        load_task(f"{task_file}:needs_width", depth=3)
    message = str(info.value)
    assert "the factory requires width, and no value was given" in message
    assert "hint: pass --task-arg width=VALUE" in message
    assert load_task(f"{task_file}:needs_width", width=4).batch_size == 2


@pytest.mark.parametrize(
    ("spec", "hint"),
    [
        ("digits", "hint: the built-in example is 'example:digits'"),
        ("example:digit", "hint: did you mean 'example:digits'?"),
        ("train.py", "e.g. 'train.py:make_task'"),
        ("mypkg.tasks", "e.g. 'mypkg.tasks:make_task'"),
    ],
)
def test_a_spec_one_step_from_a_working_one_names_it(spec, hint):
    with pytest.raises(TaskSpecError) as raised:
        load_task(spec)
    assert str(raised.value).endswith(hint)


def test_a_file_spec_without_its_factory_names_the_functions_the_file_defines(tmp_path):
    one = tmp_path / "one.py"
    one.write_text("import torch\n\n\ndef make(width=4):\n    return None\n\n\ndef _helper():\n    pass\n")
    with pytest.raises(TaskSpecError) as raised:
        load_task(str(one))
    assert str(raised.value).endswith(f"hint: did you mean '{one}:make'?")  # read, not run: nothing imported
    (tmp_path / "two.py").write_text("def make_small():\n    pass\n\n\ndef make_large():\n    pass\n")
    with pytest.raises(TaskSpecError) as raised:
        load_task(str(tmp_path / "two.py"))
    assert str(raised.value).endswith("hint: name the function that returns the Task (or model), one of: "
                                      "make_small, make_large")  # fmt: skip


def test_a_spec_that_resembles_nothing_gets_the_forms_alone():
    with pytest.raises(TaskSpecError) as raised:
        load_task("example:zzz")
    assert "hint" not in str(raised.value) and "'example:NAME' (NAME in: digits, chargpt)" in str(raised.value)


def test_an_unknown_task_option_names_the_nearest_the_factory_takes():
    with pytest.raises(TaskSpecError) as raised:
        load_task("example:chargpt", n_layers=2)
    message = str(raised.value)
    assert "unknown option(s) n_layers" in message and message.endswith("hint: did you mean n_layer?")
    with pytest.raises(TaskSpecError, match="hint: drop it, or add it as a parameter of the factory"):
        load_task("example:chargpt", colour="red")


def test_a_task_file_imports_the_modules_beside_it_as_python_runs_it(tmp_path: Path, monkeypatch) -> None:
    # `python slow.py` finds a sibling module; the task file's import of it raised ModuleNotFoundError.
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))  # what the load appends goes with the test
    monkeypatch.chdir(tmp_path)  # the file's folder is not the working directory
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "redline_sibling_models_1f3.py").write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\nfrom redline import Task\n\n"
        "def make():\n    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))\n"
        "    return Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, "
        "batch_size=4, name='beside')\n"
    )
    (folder / "train_tasks.py").write_text("from redline_sibling_models_1f3 import make\n")
    monkeypatch.delitem(sys.modules, "redline_sibling_models_1f3", raising=False)
    assert load_task("project/train_tasks.py:make").name == "beside"


def test_a_task_files_sibling_comes_before_an_installed_module_of_the_same_name(tmp_path: Path, monkeypatch) -> None:
    """`python train.py` imports the example.py beside it; the load found an installed example.py first."""
    import sys

    installed, folder = tmp_path / "site", tmp_path / "project"
    installed.mkdir()
    folder.mkdir()
    (installed / "redline_shadow_3c1.py").write_text("NAME = 'installed'\n")
    (folder / "redline_shadow_3c1.py").write_text("NAME = 'beside'\n")
    (folder / "train_task.py").write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\nfrom redline import Task\n"
        "from redline_shadow_3c1 import NAME\n\n"
        "def make():\n    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))\n"
        "    return Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, "
        "batch_size=4, name=NAME)\n"
    )
    monkeypatch.setattr(sys, "path", [str(installed), *sys.path])
    monkeypatch.delitem(sys.modules, "redline_shadow_3c1", raising=False)
    assert load_task(f"{folder / 'train_task.py'}:make").name == "beside"
    sys.modules.pop("redline_shadow_3c1", None)


def test_a_task_file_is_imported_under_its_own_name_unless_that_names_another_module(
    tmp_path: Path, monkeypatch
) -> None:
    """Loader workers started by spawn import a dataset class by its module's name: a made-up one they cannot."""
    import csv
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    body = (
        "import torch\nfrom torch import nn\nfrom redline import Task\n\n"
        "class Items(torch.utils.data.Dataset):\n    def __len__(self):\n        return 8\n\n"
        "    def __getitem__(self, i):\n        return torch.randn(4), i % 2\n\n"
        "def make():\n    return Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, "
        "train_data=Items(), batch_size=4)\n"
    )
    for name in ("redline_own_name_8e2", "csv"):
        (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.delitem(sys.modules, "redline_own_name_8e2", raising=False)
    task = load_task(f"{tmp_path / 'redline_own_name_8e2.py'}:make")
    assert type(task.train_data).__module__ == "redline_own_name_8e2"
    assert sys.modules["redline_own_name_8e2"].__file__ == str(tmp_path / "redline_own_name_8e2.py")
    sys.modules.pop("redline_own_name_8e2")
    # the standard library's name stays the standard library's
    assert type(load_task(f"{tmp_path / 'csv.py'}:make").train_data).__module__.startswith("redline_task_")
    assert sys.modules["csv"] is csv


def test_a_spec_may_name_a_task_the_module_built_as_well_as_a_factory(tmp_path: Path, monkeypatch) -> None:
    """Before, `tasks.py:TASK` for `TASK = Task(...)` said the file had no callable 'TASK' and listed the others."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "redline_built_task_2b7.py").write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\nfrom redline import Task\n\n"
        "TASK = Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, "
        "train_data=TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4, name='built')\n"
    )
    monkeypatch.delitem(sys.modules, "redline_built_task_2b7", raising=False)
    spec = f"{tmp_path / 'redline_built_task_2b7.py'}:TASK"
    assert load_task(spec).name == "built"
    with pytest.raises(TaskSpecError) as raised:  # it said "the factory accepts: no options", of no factory
        load_task(spec, width=3)
    assert str(raised.value) == (
        f"task spec {spec!r}: TASK is a Task built at import; it takes no --task-arg (given: width)\nhint: drop the "
        "--task-arg, or make TASK a function that takes it as a parameter and returns the Task"
    )
    sys.modules.pop("redline_built_task_2b7", None)


def test_a_module_that_cannot_be_copied_is_refused_with_the_factory_to_pass_instead() -> None:
    """Its deepcopy's TypeError was shown at the standard library's line, with a hint about lazy modules."""
    import threading

    class Locked(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 2)
            self.lock = threading.Lock()

    with pytest.raises(ConfigError, match=r"^model=<Locked> is not allowed; expected a module that can be copied") as e:
        tiny_task(model=Locked()).build_model()
    assert "TypeError: cannot pickle '_thread.lock' object" in str(e.value)
    assert str(e.value).endswith("hint: pass the factory that builds it instead: model=lambda: Locked(...), or "
                                 "model=Locked where it takes no arguments")  # fmt: skip
    assert isinstance(tiny_task(model=Locked).build_model(), Locked)


def test_a_mistyped_name_lists_and_suggests_a_task_the_module_built_as_it_was_imported(tmp_path: Path) -> None:
    # `--task tasks.py:TASKS` listed only the functions ("defined there: needs"), leaving out the TASK it trains
    made = tmp_path / "built.py"
    made.write_text(
        "import torch\nfrom torch import nn\nimport redline\n\n\ndef needs(x):\n    return x\n\n\n"
        "TASK = redline.Task(model=nn.Linear(2, 1), loss_fn=nn.functional.mse_loss,\n"
        "                    train_data=torch.utils.data.TensorDataset(torch.randn(4, 2), torch.randn(4, 1)))\n"
    )
    with pytest.raises(TaskSpecError) as info:
        load_task(f"{made}:TASKS")
    assert "defined there: TASK, needs" in str(info.value)
    assert f"hint: did you mean '{made}:TASK'?" in str(info.value)
