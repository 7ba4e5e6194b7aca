"""--task-arg reads each value as the README and docs/errors.md say it does."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from redline.cli.task_args import convert_task_args

ROOT = Path(__file__).resolve().parents[2]


def said(doc: str) -> str:
    return " ".join((ROOT / doc).read_text().split())


def test_an_option_whose_default_is_none_takes_none_with_or_without_an_annotation():
    assert "an option whose default is `None` also takes none; an option without an annotation" in said("README.md")
    assert "or an option whose default is `None`, also takes `none`" in said("docs/errors.md")

    def make(checkpoint=None, steps: int = None, name="tiny"):  # type: ignore[assignment]  # noqa: RUF013
        pass

    read = convert_task_args(make, {"checkpoint": "none", "steps": "None", "name": "none"})
    assert read == {"checkpoint": None, "steps": None, "name": "none"}, "a default of None reads none; text stays"
    assert convert_task_args(make, {"checkpoint": "runs/x"}) == {"checkpoint": "runs/x"}
    assert convert_task_args(make, {"checkpoint": "[1, 2]"}) == {"checkpoint": [1, 2]}, "a Python literal, as before"


def test_an_option_that_also_takes_a_str_keeps_the_text_as_docs_errors_says():
    assert "An option that also takes a `str` (`str | os.PathLike`, `str | torch.device`) keeps the text as typed" in (
        said("docs/errors.md")
    )

    def make(root: str | os.PathLike = "data", device: str | torch.device = "cpu"):
        pass

    assert convert_task_args(make, {"root": "s3://bucket", "device": "cpu"}) == {"root": "s3://bucket", "device": "cpu"}
