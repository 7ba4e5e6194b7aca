"""A task spec one step from a valid one gets the hint docs/errors.md promises, naming the spec meant."""

from __future__ import annotations

from pathlib import Path

import pytest

from redline.errors import TaskSpecError
from redline.task import load_task

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("spec", "meant"), [("tasks", "tasks.py:make"), ("tasks.py", "tasks.py:make"), ("digit", "example:digits")]
)
def test_a_spec_without_its_colon_is_told_the_spec_it_likely_meant(spec, meant, tmp_path, monkeypatch):
    errors_md = " ".join((ROOT / "docs/errors.md").read_text().split())
    assert "a spec one step from one of these gets a hint that names it" in errors_md
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.py").write_text("def make():\n    pass\n")
    with pytest.raises(TaskSpecError) as refused:
        load_task(spec)
    assert str(refused.value).endswith(f"\nhint: did you mean '{meant}'?"), str(refused.value)
