"""--task-arg texts read by the task factory's annotations, and what a text that does not fit says."""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import textwrap
from pathlib import Path
from typing import Literal, Optional

import pytest
import torch

from redline.cli.task_args import (
    check_given_task,
    convert_task_args,
    given_factory,
    load_given_servable,
    load_given_task,
)
from redline.errors import ConfigError, TaskSpecError
from redline.task import call_factory, find_factory, load_task

UNANNOTATED = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.task import Task


def make(batch_size=2, name="tiny"):
    data = TensorDataset(torch.randn(4, 2), torch.randn(4, 1))
    return Task(model=nn.Linear(2, 1), loss_fn=nn.functional.mse_loss, train_data=data,
                batch_size=batch_size, name=name)
"""


def test_pairs_must_be_key_equals_value_and_read_by_the_factory() -> None:
    # digits(width: int, lr: float, ...): "8" becomes 8 and "3e-4" a float, not the texts.
    assert given_factory("example:digits", ["width=8", "lr=3e-4"])[1] == {"width": 8, "lr": 3e-4}
    assert given_factory("example:digits", [])[1] == {}
    with pytest.raises(ConfigError, match=r"KEY=VALUE.*\nhint: e.g. --task-arg width=VALUE$"):
        given_factory("example:digits", ["width"])  # the key is there, its value is not: say where it goes
    with pytest.raises(ConfigError, match=r"KEY=VALUE.*\nhint: e.g. --task-arg n_layer=4$"):
        given_factory("example:digits", ["2x=1"])


def test_a_key_given_twice_with_two_values_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match="each KEY once; width is also given as --task-arg width=8") as caught:
        given_factory("example:digits", ["width=8", "lr=0.1", "width=16"])
    assert "--task-arg='width=16' is not allowed" in str(caught.value)
    assert given_factory("example:digits", ["width=8", "width=8"])[1] == {"width": 8}  # the same twice: no doubt


def typed_factory(
    flag: bool = False,
    n: int = 1,
    lr: float = 0.1,
    name: str = "tiny",
    size: Literal["small", "large"] = "small",
    limit: int | None = None,
    label: Optional[str] = None,  # noqa: UP045 - the spelling older factories use
    either: int | str = 0,
    untyped=None,
) -> None:
    """A factory whose options carry every annotation the conversion reads."""


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        ({"flag": "false"}, {"flag": False}),
        ({"flag": "TRUE"}, {"flag": True}),
        ({"flag": "0"}, {"flag": False}),
        ({"flag": "yes"}, {"flag": True}),
        ({"flag": "Off"}, {"flag": False}),
        ({"n": "12"}, {"n": 12}),
        ({"n": "4e5"}, {"n": 400_000}),  # a whole number written short
        ({"n": "-2E3"}, {"n": -2000}),
        ({"limit": "1e6"}, {"limit": 1_000_000}),
        ({"lr": "3e-4"}, {"lr": 3e-4}),
        ({"lr": "2"}, {"lr": 2.0}),
        ({"name": "123"}, {"name": "123"}),
        ({"name": "[1, 2]"}, {"name": "[1, 2]"}),
        ({"size": "large"}, {"size": "large"}),
        ({"limit": "none"}, {"limit": None}),
        ({"limit": "None"}, {"limit": None}),
        ({"limit": "7"}, {"limit": 7}),
        ({"label": "None"}, {"label": None}),
        ({"label": "hello"}, {"label": "hello"}),
        ({"either": "5"}, {"either": 5}),
        ({"either": "five"}, {"either": "five"}),
        ({"untyped": "[1, 2]"}, {"untyped": [1, 2]}),
        ({"untyped": "tiny"}, {"untyped": "tiny"}),
        ({"unknown": "3"}, {"unknown": 3}),  # not the factory's: calling it names the unknown option
    ],
)
def test_task_args_convert_by_the_annotation(texts: dict[str, str], expected: dict[str, object]) -> None:
    options = convert_task_args(typed_factory, texts)
    assert options == expected
    assert [type(v) for v in options.values()] == [type(v) for v in expected.values()]


@pytest.mark.parametrize(
    ("key", "text", "says"),
    [
        ("flag", "maybe", "--task-arg flag='maybe': the factory's option 'flag' is a bool; expected true or false"),
        ("flag", "", "option 'flag' is a bool"),
        ("n", "2.5", "--task-arg n='2.5': the factory's option 'n' is an int; expected a whole number"),
        ("n", "1e-3", "option 'n' is an int; expected a whole number"),
        ("n", "2.5e0", "option 'n' is an int; expected a whole number"),
        ("n", "1e300", "option 'n' is an int; expected a whole number"),  # not exact as a float
        ("lr", "fast", "option 'lr' is a float; expected a number"),
        ("size", "medium", "option 'size' is a Literal['small', 'large']; expected one of small, large"),
        ("limit", "lots", "option 'limit' is annotated int | None; expected a whole number or none"),
    ],
)
def test_task_arg_that_does_not_convert_names_option_type_and_text(key: str, text: str, says: str) -> None:
    with pytest.raises(TaskSpecError) as info:
        convert_task_args(typed_factory, {key: text})
    message = str(info.value)
    assert says in message
    assert f"\nhint: e.g. --task-arg {key}=" in message
    converted = message.split(f"--task-arg {key}=")[-1]
    assert convert_task_args(typed_factory, {key: converted})  # the hint's example is itself a valid text


def test_an_option_whose_default_is_none_also_reads_none() -> None:
    def make(  # the implicit Optional that older factories are written with
        *,
        steps: int = None,  # type: ignore[assignment]  # noqa: RUF013
        mode: Literal["a", "b"] = None,  # type: ignore[assignment]  # noqa: RUF013
        root: Path = None,  # type: ignore[assignment]  # noqa: RUF013
    ) -> None:
        pass

    assert convert_task_args(make, {"steps": "none", "mode": "None", "root": "none"}) == dict.fromkeys(
        ("steps", "mode", "root")
    )  # the default given back, not "expected a whole number" (nor Path("none"))
    assert convert_task_args(make, {"steps": "3", "mode": "b", "root": "data"}) == {
        "steps": 3,
        "mode": "b",
        "root": Path("data"),
    }
    with pytest.raises(
        TaskSpecError, match=re.escape("'steps' is annotated int | None; expected a whole number or none")
    ):
        convert_task_args(make, {"steps": "many"})


def test_task_args_of_a_factory_whose_annotation_does_not_resolve(tmp_path: Path) -> None:
    path = tmp_path / "lazy_tasks.py"
    path.write_text(
        textwrap.dedent(
            """
            from __future__ import annotations
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from collections import OrderedDict

            def make(flag: bool = True, table: OrderedDict | None = None, n: int = 1):
                pass
            """
        )
    )
    factory = find_factory(f"{path}:make")
    # get_type_hints fails on OrderedDict; the other annotations still apply, that one reads as before.
    assert convert_task_args(factory, {"flag": "off", "n": "3", "table": "{1: 2}"}) == {
        "flag": False,
        "n": 3,
        "table": {1: 2},
    }


def test_task_args_of_a_class_and_of_a_callable_object() -> None:
    class Factory:
        def __init__(self, flag: bool = True) -> None:
            self.flag = flag

    class CallableFactory:
        def __call__(self, flag: bool = True) -> None:
            pass

    assert convert_task_args(Factory, {"flag": "no"}) == {"flag": False}
    assert convert_task_args(CallableFactory(), {"flag": "no"}) == {"flag": False}


def collection_factory(
    *,
    sizes: list[int] = [1],  # noqa: B006 - read, never changed
    dims: tuple[int, ...] = (1,),
    pair: tuple[int, str] = (1, "a"),
    rates: set[float] | None = None,
    table: dict[str, int] | None = None,
    root: Path = Path("."),
    out: Path | None = None,
) -> None:
    """A factory whose options are collections and paths."""


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        ({"sizes": "1,2"}, {"sizes": [1, 2]}),
        ({"sizes": "[1, 2]"}, {"sizes": [1, 2]}),
        ({"sizes": "5"}, {"sizes": [5]}),  # one item is a list of one, not the number
        ({"dims": "64"}, {"dims": (64,)}),
        ({"dims": "(8, 8)"}, {"dims": (8, 8)}),
        ({"pair": "3,b"}, {"pair": (3, "b")}),
        ({"rates": "1,2.5"}, {"rates": {1.0, 2.5}}),
        ({"rates": "none"}, {"rates": None}),
        ({"table": "{'a': 2}"}, {"table": {"a": 2}}),
        ({"root": "/data/x"}, {"root": Path("/data/x")}),  # a Path, so root.exists() works in the factory
        ({"out": "runs/a"}, {"out": Path("runs/a")}),
        ({"out": "none"}, {"out": None}),  # not Path("none")
    ],
)
def test_collections_and_paths_read_as_annotated(texts: dict[str, str], expected: dict[str, object]) -> None:
    options = convert_task_args(collection_factory, texts)
    assert options == expected
    assert [type(v) for v in options.values()] == [type(v) for v in expected.values()]


@pytest.mark.parametrize(
    ("key", "text", "says"),
    [
        ("sizes", "abc", "option 'sizes' is a list[int]; expected values separated by commas, each a whole number"),
        ("sizes", "[1, 'x']", "option 'sizes' is a list[int]"),
        ("dims", "1.5", "option 'dims' is a tuple[int, ...]"),
        ("pair", "1", "'pair' is a tuple[int, str]; expected 2 values separated by commas: a whole number, text"),
        ("rates", "fast", "option 'rates' is annotated set[float] | None"),
        ("table", "a=1", "option 'table' is annotated dict[str, int] | None; expected a Python dict or none"),
        ("root", "", "option 'root' is a Path; expected a path"),
    ],
)
def test_a_collection_or_path_that_does_not_convert_is_refused(key: str, text: str, says: str) -> None:
    with pytest.raises(TaskSpecError) as info:
        convert_task_args(collection_factory, {key: text})
    message = str(info.value)
    assert says in message
    example = message.split(f"hint: e.g. --task-arg {key}=")[-1]
    assert convert_task_args(collection_factory, {key: example})  # the hint's example is itself a valid text


def test_load_task_takes_real_values_and_texts_go_through_the_conversion(tmp_path: Path) -> None:
    path = tmp_path / "plain_tasks.py"
    path.write_text(UNANNOTATED)
    spec = f"{path}:make"
    assert load_task(spec, batch_size=3).batch_size == 3  # Python callers pass values, not texts
    factory = find_factory(spec)
    task = call_factory(spec, factory, convert_task_args(factory, {"batch_size": "3", "name": "big"}))
    assert (task.batch_size, task.name) == (3, "big")  # make() has no annotations: a literal, else the text


def test_an_option_without_an_annotation_reads_as_its_defaults_type():
    """`augment=False` took "false" as the text 'false', which is true; `width=8` took "8.0" as a float, which failed
    deep in the model; `name="run"` took "123" as the number 123."""

    def factory(augment=False, width=8, lr=1e-3, name="run", other=None):
        return None

    read = convert_task_args(factory, {"augment": "false", "width": "16", "lr": "3e-4", "name": "123", "other": "[1]"})
    assert read == {"augment": False, "width": 16, "lr": 3e-4, "name": "123", "other": [1]}
    assert type(read["lr"]) is float and convert_task_args(factory, {"lr": "1"}) == {"lr": 1.0}
    with pytest.raises(TaskSpecError, match=r"--task-arg width='8\.5': the factory's option 'width' is an int"):
        convert_task_args(factory, {"width": "8.5"})


@pytest.mark.parametrize(
    ("text", "read"),
    [("false", False), ("FALSE", False), ("True", True), ("true", True), ("none", None), ("NONE", None),
     ("0.5", 0.5), ("3", 3), ("[1, 2]", [1, 2]), ("off", "off"), ("tiny", "tiny")],
)  # fmt: skip
def test_an_untyped_option_reads_true_false_and_none_in_any_case(text: str, read: object) -> None:
    """`def make(augment=None)` given `--task-arg augment=false` got the text 'false', which is true: augmentation on.
    Through **kwargs too."""

    def factory(augment=None, **options):
        return None

    assert convert_task_args(factory, {"augment": text, "extra": text}) == {"augment": read, "extra": read}


def test_a_path_option_expands_the_home_directory_as_out_does(monkeypatch, tmp_path):
    """`--task-arg=path=~/x` reached the factory as Path('~/x'), where --out and --resume expand it."""
    monkeypatch.setenv("HOME", str(tmp_path))

    def factory(path: Path):
        return None

    assert convert_task_args(factory, {"path": "~/data"}) == {"path": tmp_path / "data"}


COUNTED = """
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.task import Task

with open(Path(__file__).with_suffix(".imports"), "a") as imports:  # one line each time the file runs
    imports.write("imported\\n")


def make(batch_size: int = 2):
    data = TensorDataset(torch.randn(4, 2), torch.randn(4, 1))
    return Task(model=nn.Linear(2, 1), loss_fn=nn.functional.mse_loss, train_data=data, batch_size=batch_size)
"""


@pytest.mark.parametrize("command", ["train", "train --nproc", "serve"])
def test_a_task_file_given_task_args_is_imported_once(tmp_path: Path, command: str) -> None:
    """The factory was found once to read the texts and once more to call it: the file's top level ran twice, so data
    drawn at import changed under the same --seed."""
    path = tmp_path / "counted_tasks.py"
    path.write_text(COUNTED)
    spec, pairs = f"{path}:make", ["batch_size=3"]
    if command == "train":
        assert load_given_task(spec, pairs).batch_size == 3
    elif command == "train --nproc":
        check_given_task(spec, pairs)  # the launcher's check before it starts the workers
    else:
        assert load_given_servable(spec, pairs, weights=None).input_shape == (2,)
    assert path.with_suffix(".imports").read_text().splitlines() == ["imported"]


class Pool(enum.Enum):
    MEAN = "mean"
    MAX = "max"


@dataclasses.dataclass
class Optim:
    lr: float = 0.01
    momentum: float = 0.9


def class_factory(
    pool: Pool = Pool.MEAN,
    pools: list[Pool] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    scale: complex = 1j,
    optim: Optim = Optim(),  # noqa: B008 - read, never changed
) -> None:
    """A factory whose options are classes: an Enum, torch's dtype and device, a literal's type, a dataclass."""


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        ({"pool": "MAX"}, {"pool": Pool.MAX}),  # by name: the member itself, so `pool is Pool.MAX` holds
        ({"pool": "max"}, {"pool": Pool.MAX}),  # by value
        ({"pool": "Mean"}, {"pool": Pool.MEAN}),  # in any case
        ({"pools": "MAX,mean"}, {"pools": [Pool.MAX, Pool.MEAN]}),
        ({"dtype": "bfloat16"}, {"dtype": torch.bfloat16}),
        ({"dtype": "torch.float16"}, {"dtype": torch.float16}),
        ({"device": "cuda:1"}, {"device": torch.device("cuda:1")}),
        ({"device": "none"}, {"device": None}),
        ({"scale": "2+1j"}, {"scale": 2 + 1j}),  # a Python literal that is one
    ],
)
def test_an_enum_a_dtype_and_a_device_read_as_such(texts: dict[str, str], expected: dict[str, object]) -> None:
    """An Enum option got the text 'MAX', so `pool is Pool.MAX` was False and the factory silently took its default
    branch; a torch.dtype got 'bfloat16', which no tensor takes as a dtype."""
    options = convert_task_args(class_factory, texts)
    assert options == expected
    assert [type(v) for v in options.values()] == [type(v) for v in expected.values()]


@pytest.mark.parametrize(
    ("key", "text", "says"),
    [
        ("pool", "min", "--task-arg pool='min': the factory's option 'pool' is a Pool; expected one of MEAN, MAX"),
        ("dtype", "f32", "option 'dtype' is a torch.dtype; expected a dtype's name: float32, bfloat16"),
        ("device", "gpu0", "option 'device' is annotated torch.device | None; expected a device: cpu, cuda"),
        ("scale", "big", "option 'scale' is a complex; expected a Python literal that is a complex"),
    ],
)
def test_a_text_that_is_no_member_or_dtype_is_refused_with_the_choices(key: str, text: str, says: str) -> None:
    with pytest.raises(TaskSpecError) as info:
        convert_task_args(class_factory, {key: text})
    message = str(info.value)
    assert says in message
    example = message.split(f"hint: e.g. --task-arg {key}=")[-1]
    assert convert_task_args(class_factory, {key: example})  # the hint's example is itself a valid text


@pytest.mark.parametrize("text", ["0.1", "{'lr': 0.1}", "Optim(lr=0.1)"])
def test_an_option_of_a_class_no_text_can_build_is_refused_naming_its_fields(text: str) -> None:
    """A dataclass option got the text (or a dict) in place of the instance, and failed, if at all, deep in the
    factory."""
    with pytest.raises(TaskSpecError) as info:
        convert_task_args(class_factory, {"optim": text})
    assert str(info.value) == (
        f"--task-arg optim={text!r}: the factory's option 'optim' is an Optim, which --task-arg cannot build from a "
        "text\nhint: make Optim's fields the factory's own parameters and build it there: def make(lr: float = "
        "0.01, momentum: float = 0.9): ... Optim(lr=lr, momentum=momentum), then --task-arg lr=..."
    )


def text_or_factory(
    data_root: str | os.PathLike = "data",
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    out: Path | str | None = None,
    pool: Pool | str = Pool.MEAN,
    mode: Literal["fast"] | str = "fast",
    either: bool | int | str = 0,
) -> None:
    """A factory whose options take a str or something else; a str keeps the text as given."""


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        ({"data_root": "s3://bucket/train"}, {"data_root": "s3://bucket/train"}),  # not Path('s3:/bucket/train')
        ({"device": "cpu"}, {"device": "cpu"}),  # so the factory's device.startswith("cuda") works
        ({"dtype": "half"}, {"dtype": "half"}),  # not torch.float16
        ({"out": "runs//a"}, {"out": "runs//a"}),
        ({"out": "none"}, {"out": None}),  # none, Enums, Literals, bools and numbers still read ahead of str
        ({"pool": "max"}, {"pool": Pool.MAX}),
        ({"pool": "median"}, {"pool": "median"}),
        ({"mode": "fast"}, {"mode": "fast"}),
        ({"either": "true"}, {"either": True}),
        ({"either": "7"}, {"either": 7}),
    ],
)
def test_a_str_option_keeps_its_text_ahead_of_a_path_a_device_or_a_dtype(
    texts: dict[str, str], expected: dict[str, object]
) -> None:
    """`data_root: str | os.PathLike` got PosixPath('s3:/bucket/train'), its // collapsed, and `device: str |
    torch.device` a torch.device that the factory's `device.startswith` failed on."""
    options = convert_task_args(text_or_factory, texts)
    assert options == expected
    assert [type(v) for v in options.values()] == [type(v) for v in expected.values()]
