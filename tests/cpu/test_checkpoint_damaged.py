"""A checkpoint file whose bytes cannot be parsed though they match the manifest (written damaged by a fault, or the
manifest rewritten since) is a CheckpointError naming the file and the checkpoint before it, not a reader's
traceback (SafetensorError, torch's zip reader, JSONDecodeError)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from redline import Runtime
from redline.checkpoint import CheckpointError, load_plan
from redline.checkpoint.layout import file_entry, read_checkpoint, step_dir


def saved_twice(root: Path) -> None:
    with Runtime(devices="cpu") as rt:
        torch.manual_seed(0)
        model, optimizer = rt.setup(nn.Linear(4, 2), lambda params: torch.optim.AdamW(params))
        for step in (1, 2):
            rt.backward(model(torch.randn(8, 4)).square().mean())
            rt.step(optimizer)
            rt.save(step_dir(root, step), step=step)


def damage(checkpoint: Path, name: str, garble) -> None:
    """Garble one file of ``checkpoint`` and record the result in its manifest, as a writer's fault would."""
    path = checkpoint / name
    path.write_bytes(garble(path.read_bytes()))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = file_entry(path)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("name", "garble", "reader"),
    [
        ("model.safetensors", lambda data: data[:-8], "SafetensorError"),
        ("optimizer.pt", lambda data: data[:-8], "RuntimeError: PytorchStreamReader failed"),
        ("extra.pt", lambda data: b"not a checkpoint file", "UnpicklingError"),
    ],
)
def test_a_file_that_matches_its_manifest_but_cannot_be_parsed_is_named_with_the_checkpoint_before_it(
    tmp_path: Path, name: str, garble, reader: str
) -> None:
    saved_twice(tmp_path)
    damage(step_dir(tmp_path, 2), name, garble)
    with Runtime(devices="cpu") as rt, pytest.raises(CheckpointError) as raised:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.AdamW(params))
        rt.load(step_dir(tmp_path, 2))
    message = str(raised.value)
    assert message.startswith(f"{step_dir(tmp_path, 2) / name} cannot be read ({reader}"), message
    assert "though its size and checksum are those its manifest records: it was written damaged" in message
    assert f"hint: move {step_dir(tmp_path, 2)} out of {tmp_path} (to look at it later) and resume from the " in message
    assert f"checkpoint before it, {step_dir(tmp_path, 1)}: where this one was the newest, --resume auto" in message


def test_a_garbled_plan_is_named_and_a_first_checkpoint_has_none_before_it(tmp_path: Path) -> None:
    saved_twice(tmp_path)
    damage(step_dir(tmp_path, 1), "plan.json", lambda data: b"not json")
    with pytest.raises(CheckpointError) as raised:
        load_plan(read_checkpoint(step_dir(tmp_path, 1)))
    message = str(raised.value)
    assert message.startswith(f"{step_dir(tmp_path, 1) / 'plan.json'} cannot be read (JSONDecodeError: Expecting")
    assert message.endswith("hint: no earlier checkpoint of the run is beside it: start the run again (another --out)")


def test_a_value_the_safe_load_refuses_is_still_told_as_such(tmp_path: Path) -> None:
    saved_twice(tmp_path)
    damage(step_dir(tmp_path, 2), "extra.pt", lambda data: _pickled_with_a_path())
    with Runtime(devices="cpu") as rt, pytest.raises(CheckpointError, match="holds a value that loading without"):
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.AdamW(params))
        rt.load(step_dir(tmp_path, 2))


def _pickled_with_a_path() -> bytes:
    buffer = io.BytesIO()
    torch.save({"where": Path("/tmp")}, buffer)
    return buffer.getvalue()


def test_a_checkpoint_that_does_not_verify_gives_the_python_fix_beside_the_flag(tmp_path: Path) -> None:
    # Its hint named --resume auto alone, to a loop of one's own that called rt.load.
    saved_twice(tmp_path)
    path = step_dir(tmp_path, 2) / "optimizer.pt"
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    with Runtime(devices="cpu") as rt, pytest.raises(CheckpointError) as raised:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.AdamW(params))
        rt.load(step_dir(tmp_path, 2))
    assert "optimizer.pt does not match its checksum (corrupt)" in str(raised.value)
    assert str(raised.value).endswith("in Python, Trainer(resume='auto'), or rt.load of the one before)")


@pytest.mark.parametrize(
    "raised",
    [
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"),
        MemoryError(),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
    ],
)
def test_a_failure_that_is_no_damage_of_the_files_passes_as_it_is(tmp_path: Path, monkeypatch, raised) -> None:
    # Every exception a reader raised was called damage, and the hint told the user to set a good checkpoint aside.
    saved_twice(tmp_path)

    def fails(*args, **kwargs):
        raise raised

    monkeypatch.setattr(torch, "load", fails)
    with Runtime(devices="cpu") as rt, pytest.raises(type(raised)) as passed:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.AdamW(params))
        rt.load(step_dir(tmp_path, 2))
    assert passed.value is raised
