"""Fixtures the unit tests of several files share."""

import pytest

from redline.runtime import measure
from redline.runtime.trial import Measured


@pytest.fixture
def asked_rounds(tmp_path, monkeypatch):
    """Plan as on an AMX CPU, with an empty trial cache; fake the trial (bf16 steps in 0.7 of fp32's time) and record
    the rounds each trial was given."""
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("REDLINE_CPU", "amx")
    asked = []

    def fake_trial(model, optimizer, loss_fn, batch, device, candidates, *, rounds=4, **_):
        asked.append(rounds)
        return [Measured(name, (ms / 1e3,) * 12, (2.0, 1.8)) for name, ms in (("fp32", 10.0), ("bf16-mixed", 7.0))]

    monkeypatch.setattr(measure, "run_trial", fake_trial)
    return asked
