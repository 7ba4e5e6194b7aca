"""What the commands print is what README.md and docs/ say they print.

Each test runs a command as a page shows it (with a small model and few steps) and checks the part of
its output the page describes, quoting the page where it can.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import torch
from serve_engines import FakeEngine
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import redline
from redline.cli import serve as serve_cli
from redline.cli.main import app
from redline.serve.app import build_app
from redline.serve.options import ServeOptions

ROOT = Path(__file__).resolve().parents[2]
TASK_FILE = """\
import torch
from torch import nn
from torch.utils.data import TensorDataset
import redline


def make():
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    model = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return redline.Task(model=model, loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x, y),
                        batch_size=16, name="tiny")
"""
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def test_redline_serve_says_its_default_buckets_are_the_default_as_engine_md_shows(monkeypatch):
    engine_md = " ".join((ROOT / "docs/engine.md").read_text().split())
    said = "powers of two up to max_batch_size; a batch is padded up to the next bucket"
    assert f"| `buckets` | `1, 2, 4, 8, 16, 32` | `{said}` |" in engine_md
    served = []
    monkeypatch.setattr(serve_cli, "serve", lambda engine, options, **kwargs: served.append(engine))
    args = ["serve", "example:digits", "--port", "0", "--measure", "off"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (engine,) = served
    assert engine.plan_dict()["buckets"] == {"value": [1, 2, 4, 8, 16, 32], "reason": said}
    given = CliRunner().invoke(app, [*args, "--max-batch-size", "8", "--batch-buckets", "1,8"])
    assert given.exit_code == 0, given.output
    assert served[1].plan_dict()["buckets"]["reason"].startswith("requested;"), "sizes typed are the user's own"


class FitsUpTo21(nn.Module):
    """A model whose step runs out of memory above 21 samples, as a full device would."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 21:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows")
        return self.linear(x)


def printed_as_commented(code: str) -> list[str]:
    """The lines a block's ``print(...)  # OUTPUT`` statements say they print, each a pattern ('...': any text)."""
    comments = [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(")]
    return [".*".join(re.escape(part) for part in comment.split("...")) for comment in comments]


def test_the_readme_batch_search_prints_what_its_comments_show(capsys):
    (code,) = [block for block in PYTHON_BLOCK.findall((ROOT / "README.md").read_text()) if "find_batch_size" in block]
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    task = redline.Task(model=FitsUpTo21, loss_fn=nn.functional.cross_entropy, train_data=data, name="fits21")
    exec(compile(code, "README.md", "exec"), {"redline": redline, "task": task})  # the README's own example
    printed = capsys.readouterr().out.splitlines()
    expected = printed_as_commented(code)
    assert len(printed) == len(expected) and expected, printed
    for line, pattern in zip(printed, expected, strict=True):
        assert re.fullmatch(pattern, line), f"README says it prints {pattern!r}; it printed {line!r}"


def test_redline_memory_json_holds_the_keys_docs_memory_md_names(tmp_path, monkeypatch):
    text = " ".join((ROOT / "docs/memory.md").read_text().split())
    paragraph = text.split("`--json` prints ", 1)[1].split(" ## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", paragraph)) - {"cuda", "cpu"}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.py").write_text(TASK_FILE)
    result = CliRunner().invoke(app, ["memory", "--task", "tasks.py:make", "--gpu", "l4", "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    keys = set(found) | {key for row in found["rows"] for key in (*row, *row["estimate"])}
    assert keys == named, f"the JSON has {sorted(keys - named)} unnamed; the page names {sorted(named - keys)}"
    estimate = found["rows"][0]["estimate"]
    assert estimate["total"] == estimate["peak"] + estimate["workspace"], "total is peak plus workspace"
    assert found["rows"][0]["fits"] == (estimate["total"] <= found["rows"][0]["available"])


def test_a_trailing_slash_is_told_the_endpoint_meant_with_its_own_method():
    serve_md = " ".join((ROOT / "docs/serve.md").read_text().split())
    assert "A trailing slash (`/v1/predict/`) is such a path, and the message names the one meant" in serve_md
    app = build_app(FakeEngine(), ServeOptions(max_batch_size=8))

    async def answer(method: str, path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            return await client.request(method, path)

    asked = [("GET", "/v1/predict/", "POST /v1/predict"), ("POST", "/v1/predict/", "POST /v1/predict"),
             ("GET", "/readyz/", "GET /readyz")]  # fmt: skip
    for method, path, meant in asked:
        got = asyncio.run(answer(method, path))
        assert got.status_code == 404, got.text
        assert got.json()["error"].startswith(f"{method} {path}: no such endpoint; did you mean {meant} "), got.text
