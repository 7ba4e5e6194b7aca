"""What the commands print is what README.md and docs/ say they print.

Each test runs a command as a page shows it (with a small model and few steps) and checks the part of
its output the page describes, quoting the page where it can.
"""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from redline.cli import serve as serve_cli
from redline.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


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
