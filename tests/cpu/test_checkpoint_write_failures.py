"""A sharded checkpoint (FSDP's format) the disk refuses: a clear error, no staged part left, the earlier ones kept.

One process without a process group: DCP writes a single shard, through the same code every rank runs.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

from redline.checkpoint import CheckpointError, find_checkpoints, sharded, step_dir
from redline.checkpoint.sharded import save_sharded


def _save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    save_sharded(step_dir(root, step), model, optimizer, runtime_state={}, extra={"step": step}, plan={}, step=step)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _no_space(path: object) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def _assert_refused_cleanly(raised: pytest.ExceptionInfo[CheckpointError], root: Path, failed: str) -> None:
    message = str(raised.value)
    assert message.startswith(f"{root / 'step-00000002'}: the checkpoint could not be written: No space left on device")
    assert failed in message and f"the checkpoints committed before it under {root} are intact" in message
    assert "hint: free space on that disk" in message and "--resume auto" in message
    assert sorted(path.name for path in root.iterdir()) == ["step-00000001"]  # no staging directory left filling it
    assert [c.step for c in find_checkpoints(root)] == [1]


def test_a_shard_the_disk_refuses_is_a_clear_error_that_leaves_the_earlier_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _model()
    _save(tmp_path, 1, model, optimizer)
    create_stream = FileSystem.create_stream

    @contextlib.contextmanager
    def disk_full(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        if "w" in mode and ".tmp-step-00000002" in str(path):
            raise _no_space(path)
        with create_stream(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", disk_full)
    # before, DCP's own CheckpointException (a BaseException, past any `except Exception`) came out, with a
    # traceback per rank, and the staging directory stayed behind on the full disk
    with pytest.raises(CheckpointError) as raised:
        _save(tmp_path, 2, model, optimizer)
    _assert_refused_cleanly(raised, tmp_path, ".distcp")


def test_the_run_state_the_disk_refuses_is_a_clear_error_that_leaves_the_earlier_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _model()
    _save(tmp_path, 1, model, optimizer)
    save = torch.save

    def disk_full(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if ".tmp-step-00000002" in str(path):
            raise _no_space(path)
        save(obj, path, *args, **kwargs)

    monkeypatch.setattr(sharded.torch, "save", disk_full)
    with pytest.raises(CheckpointError) as raised:
        _save(tmp_path, 2, model, optimizer)
    _assert_refused_cleanly(raised, tmp_path, "runtime.pt")


def test_a_failure_other_than_the_disks_is_a_checkpoint_error_naming_the_rank_and_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = _model()
    create_stream = FileSystem.create_stream

    @contextlib.contextmanager
    def broken(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        if "w" in mode:
            raise ValueError("the storage answered nonsense")
        with create_stream(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", broken)
    with pytest.raises(CheckpointError, match=r"written: rank 0: ValueError: the storage answered nonsense"):
        _save(tmp_path, 1, model, optimizer)
    assert list(tmp_path.iterdir()) == []
