"""A disk that refuses a checkpoint's write part-way, met by the real serialisers (torch.save, safetensors).

Neither raises the OSError the system gave it: torch.save's zip writer says "unexpected pos N vs M"
(a RuntimeError), safetensors "I/O error: ... (os error 27)" (a SafetensorError). The limit on the
size of a file this process may write (RLIMIT_FSIZE) makes each write past it fail with EFBIG, as a
full disk fails with ENOSPC, inside the libraries themselves, not in a stand-in for them.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from redline import Runtime
from redline.checkpoint import CheckpointError, find_checkpoints, step_dir
from redline.checkpoint.sharded import save_sharded

resource = pytest.importorskip("resource")  # POSIX


@contextlib.contextmanager
def files_limited_to(size: int) -> Iterator[None]:
    """Let this process write no file past ``size`` bytes: each write beyond fails with EFBIG ("File too large")."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # Python ignores it already; say so here
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _trained(rt: Runtime) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A 64x64 layer (16 KiB of weights) and AdamW after a step (twice that of state)."""
    torch.manual_seed(0)
    model, optimizer = rt.setup(nn.Linear(64, 64), lambda params: torch.optim.AdamW(params))
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def _assert_refused_cleanly(raised: pytest.ExceptionInfo[CheckpointError], root: Path, failed: str) -> None:
    message = str(raised.value)
    assert message.startswith(f"{step_dir(root, 2)}: the checkpoint could not be written: File too large ("), message
    assert f"{failed})" in message and f"the checkpoints committed before it under {root} are intact" in message
    assert "hint: free space on that disk" in message
    assert sorted(path.name for path in root.iterdir()) == ["step-00000001"]  # no staged part left on the full disk
    assert [c.step for c in find_checkpoints(root)] == [1]


@pytest.mark.parametrize(
    ("limit", "failed"),
    [(4096, "model.safetensors"), (24 * 1024, "optimizer.pt")],  # the weights refused; they fit, the optimizer not
)
def test_a_checkpoint_a_full_disk_refuses_is_a_clear_error_that_leaves_the_earlier_ones(
    tmp_path: Path, limit: int, failed: str
) -> None:
    with Runtime(devices="cpu") as rt:
        _trained(rt)
        rt.save(step_dir(tmp_path, 1), step=1)
        # before, safetensors' SafetensorError or torch's "[enforce fail at inline_container.cc] unexpected pos"
        # came out as a traceback, and the staging directory stayed behind on the full disk
        with files_limited_to(limit), pytest.raises(CheckpointError) as raised:
            rt.save(step_dir(tmp_path, 2), step=2)
    _assert_refused_cleanly(raised, tmp_path, failed)


def test_a_first_checkpoint_a_full_disk_refuses_says_there_is_none_before_it(tmp_path: Path) -> None:
    # It said "the checkpoints committed before it ... are intact" where there were none to resume from.
    with Runtime(devices="cpu") as rt:
        _trained(rt)
        with files_limited_to(4096), pytest.raises(CheckpointError) as raised:
            rt.save(step_dir(tmp_path, 1), step=1)
    message = str(raised.value)
    assert f"the part written is removed, and no checkpoint was committed before it under {tmp_path}\n" in message
    assert "are intact" not in message and message.endswith("to continue from the newest (with none, it starts over)")
    assert list(tmp_path.iterdir()) == []


def test_a_sharded_checkpoints_state_a_full_disk_refuses_is_a_clear_error(tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"history": torch.zeros(16 * 1024)}  # 64 KiB of the caller's own state, in extra.pt

    def save(step: int) -> None:
        save_sharded(step_dir(tmp_path, step), model, optimizer, runtime_state={}, extra=extra, plan={}, step=step)

    save(1)
    with files_limited_to(16 * 1024), pytest.raises(CheckpointError) as raised:
        save(2)
    _assert_refused_cleanly(raised, tmp_path, "extra.pt")


def test_weights_a_full_disk_refuses_are_a_clear_error_that_leaves_the_earlier_file(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"the earlier weights")
    with Runtime(devices="cpu") as rt:
        _trained(rt)
        with files_limited_to(4096), pytest.raises(CheckpointError) as raised:
            rt.save_weights(tmp_path / "model.safetensors")
    assert str(raised.value).startswith(f"{tmp_path / 'model.safetensors'}: the weights could not be written: File too")
    assert "hint: free space on that disk" in str(raised.value)
    assert (tmp_path / "model.safetensors").read_bytes() == b"the earlier weights"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.safetensors"]  # no temporary file left


def test_a_shard_a_full_disk_refuses_is_a_clear_error_that_leaves_the_earlier_checkpoints(tmp_path: Path) -> None:
    """DCP writes each tensor through torch.save, whose RuntimeError came out as the reason, with no hint."""
    model = nn.Linear(128, 128)  # 64 KiB of weights in the rank's shard
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def save(step: int) -> None:
        save_sharded(step_dir(tmp_path, step), model, optimizer, runtime_state={}, extra={}, plan={}, step=step)

    save(1)
    with files_limited_to(16 * 1024), pytest.raises(CheckpointError) as raised:
        save(2)
    _assert_refused_cleanly(raised, tmp_path, ".distcp")
