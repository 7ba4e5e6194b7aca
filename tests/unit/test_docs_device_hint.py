"""A malformed device request ends, as docs/errors.md says every mistake does, with a hint line naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from redline.errors import ConfigError
from redline.plan.device import check_devices

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("asked", "meant"),
    [("gpu", "'cuda'"), ("GPU:1", "'cuda:1'"), ("cuda1", "'cuda:1'"), ("cpu:0", "'cpu'"), ("mps:1", "'mps'"),
     ("cdua", "'cuda'"), ("xyz", "'auto'")],
)  # fmt: skip
def test_a_malformed_device_request_says_the_one_it_likely_meant(asked, meant):
    promise = "names the object, what was expected, what came instead, and a `hint:` line with the fix"
    assert promise in " ".join((ROOT / "docs/errors.md").read_text().split())
    with pytest.raises(ConfigError) as refused:
        check_devices(asked)
    said, hint = str(refused.value).split("\nhint: ")
    assert said.startswith(f"devices={asked!r} is not allowed; expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")
    assert f"devices={meant}" in hint
