"""A checkpoint whose staging directory another run (one --out for two) removes while it is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import redline.checkpoint.whole as whole
from redline import Runtime
from redline.checkpoint import CheckpointError, clean_staging, find_checkpoints, step_dir
from redline.checkpoint.layout import stage


def test_a_staging_directory_another_run_removes_mid_write_is_named_as_such_not_as_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the write failed with "No such file or directory" and the hint to free space on the disk, and the
    staging directory the other run had made there since, for the same step, was removed as this one's."""
    final = step_dir(tmp_path, 2)
    save = whole.save_object

    def another_run_starts_and_stages_the_same_step(value: Any, path: Path) -> None:
        if path.name != "optimizer.pt":
            save(value, path)
            return
        clean_staging(tmp_path)  # what a run started in the same --out does first: this write's directory goes
        try:
            save(value, path)
        finally:  # and the other run stages its own checkpoint of this step, under the same name
            stage(final)
            (final.parent / f".tmp-{final.name}" / "model.safetensors").write_bytes(b"the other run's")

    with Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.save(step_dir(tmp_path, 1), step=1)
        monkeypatch.setattr(whole, "save_object", another_run_starts_and_stages_the_same_step)
        with pytest.raises(CheckpointError) as raised:
            rt.save(final)
    message = str(raised.value)
    assert message.startswith(f"{final}: the checkpoint could not be written: No such file or directory (")
    assert (
        f"its staging directory was removed while it was written, by another run writing checkpoints under {tmp_path}"
        in message
    )
    assert "(two runs with one --out) or by hand" in message and "free space" not in message
    assert "hint: let one run at a time write to an --out" in message
    assert (tmp_path / ".tmp-step-00000002" / "model.safetensors").read_bytes() == b"the other run's"  # left to it
    assert [c.step for c in find_checkpoints(tmp_path)] == [1]
