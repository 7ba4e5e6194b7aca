"""The Python examples of the README and docs/ run as written.

Each example leaves some names to the reader (``MyModel``, ``loader``, ``load_my_model``); the tests
give them small stand-ins and run the example's code unchanged, so an example that names an API
redline no longer has, or calls one the wrong way, fails here rather than in a user's hands.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import redline
from redline.serve import loadtest, server
from redline.serve.load_stats import RequestRecord, Setup, summarize

ROOT = Path(__file__).resolve().parents[2]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def examples(doc: str) -> list[str]:
    return PYTHON_BLOCK.findall((ROOT / doc).read_text())


def run(code: str, names: dict[str, Any], doc: str) -> None:
    exec(compile(code, str(ROOT / doc), "exec"), names)  # the docs' own examples


def digits_like(n: int = 128) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=generator), torch.randint(0, 10, (n,), generator=generator))


class MyModel(nn.Module):
    """A model of the 8x8 digits' shape: (N, 1, 8, 8) -> 10 scores."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def stand_ins() -> dict[str, Any]:
    data = digits_like()
    return {
        "__name__": "example", "torch": torch, "redline": redline, "MyModel": MyModel, "model": MyModel(),
        "loader": DataLoader(data, batch_size=32), "loss_fn": nn.functional.cross_entropy,
        "nn_module_or_factory": MyModel, "fn": nn.functional.cross_entropy, "dataset": data,
        "dataset_or_None": digits_like(64), "batch": torch.randn(5, 1, 8, 8),
    }  # fmt: skip


TASK_FILE = """\
import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline


def factory():
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 1, 8, 8, generator=generator), torch.randint(0, 10, (96,), generator=generator)
    model = lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    return redline.Task(model=model, loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x, y),
                        val_data=TensorDataset(x[:32], y[:32]), batch_size=16, name="tiny")

resnet = factory
"""


def test_the_readme_examples_run_in_order(tmp_path, monkeypatch):
    """The README read top to bottom: the Runtime loop, the Task, the Trainer, the batch search, the engine."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "tasks.py").write_text(TASK_FILE)  # mypkg.tasks:resnet
    (tmp_path / "path" / "to").mkdir(parents=True)
    (tmp_path / "path" / "to" / "file.py").write_text(TASK_FILE)  # path/to/file.py:factory
    blocks = examples("README.md")
    assert len(blocks) == 6, "an example was added or removed: give it stand-ins here"
    names = stand_ins()
    for code in blocks:
        run(code, names, "README.md")
    assert (tmp_path / "checkpoints" / "step-00001000").is_dir()  # the Runtime loop's save
    assert names["task"].name == "tiny"  # the last spec loaded: path/to/file.py:factory
    assert names["summary"].steps == 2000 and (tmp_path / "runs" / "gpt" / "metrics.csv").is_file()
    assert names["search"].largest is not None
    assert names["outputs"].shape == (5, 10)
    groups = names["adamw"](torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).parameters())
    assert [(len(g["params"]), g["weight_decay"]) for g in groups.param_groups] == [(1, 0.1), (3, 0.0)]


def test_the_engine_example_runs():
    names = stand_ins()
    (code,) = examples("docs/engine.md")
    run(code, names, "docs/engine.md")
    assert names["outputs"].shape == (5, 10) and names["engine"].ready


def test_the_serve_examples_run(monkeypatch):
    started = []
    monkeypatch.setattr(server, "serve", lambda engine, options: started.append((engine, options)))
    names = {**stand_ins(), "load_my_model": MyModel}
    servable_code, serve_code = examples("docs/serve.md")
    run("import redline\n" + servable_code, names, "docs/serve.md")
    names["servable"] = names["digits_service"]()
    run(serve_code, names, "docs/serve.md")
    assert names["app"] is not None and started == [(names["engine"], redline.ServeOptions(port=8080))]


def test_the_oom_example_runs():
    names = stand_ins()
    (code,) = examples("docs/oom.md")
    run(code, names, "docs/oom.md")
    assert names["rt"].oom_events == []  # nothing ran out of memory here


def test_the_loadtest_example_runs(tmp_path, monkeypatch):
    """A load test takes seconds against a live server: the example's call is run against a stand-in
    that answers at once, so its arguments and the result's fields it prints are checked."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "digits.json").write_text('{"inputs": [[0.0]]}')
    asked = []

    def answered_at_once(url, options, *, payload=None, progress=None):
        asked.append((url, options))
        setup = Setup(mode="open", url=url, method="POST", target_rate=options.rate, concurrency=None,
                      arrivals="uniform", duration_s=1.0, warmup_s=0.0, timeout_s=1.0, max_in_flight=8,
                      max_send_lag_ms=10.0)  # fmt: skip
        return summarize([RequestRecord(scheduled=0.1, dispatched=0.1, sent=0.1, done=0.2, status=200)], setup,
                         elapsed_s=1.0)  # fmt: skip

    monkeypatch.setattr(loadtest, "load_test", answered_at_once)
    (code,) = examples("docs/loadtest.md")
    run(code, {"__name__": "example"}, "docs/loadtest.md")
    ((url, options),) = asked
    assert url == "http://127.0.0.1:8000/v1/predict" and options.rate == 200 and options.duration_s == 20
    assert options.headers == ("Authorization: Bearer T",)  # the result's fields it prints exist, or it raised


def test_the_profile_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    names = {**stand_ins(), "task": redline.Task(model=MyModel, loss_fn=nn.functional.cross_entropy,
                                                 train_data=digits_like(), batch_size=16)}  # fmt: skip
    names["redline"] = redline
    (code,) = examples("docs/profile.md")
    run(code.replace("steps=20", "steps=2, warmup=1"), names, "docs/profile.md")  # fewer steps, the same call
    assert names["found"].breakdown.steps == 2 and (tmp_path / "trace.json.gz").is_file()
    assert "forward" in capsys.readouterr().out


@pytest.mark.parametrize("doc", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
def test_every_python_example_in_the_docs_is_run_here(doc):
    covered = {"docs/engine.md": 1, "docs/serve.md": 2, "docs/oom.md": 1, "docs/loadtest.md": 1, "docs/profile.md": 1}
    assert len(examples(doc)) == covered.get(doc, 0), f"{doc}: an example was added or removed: run it here"
