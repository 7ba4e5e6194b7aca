"""Checkpoints a write or a load cannot complete: a clear CheckpointError, and nothing of the user's lost or changed.

A full disk, a path holding the user's own files, another optimizer's state, a shard gone. The sharded
format (FSDP's) runs in one process without a process group: DCP writes a single shard, through the
same code every rank runs.
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

from redline.checkpoint import CheckpointError, find_checkpoints, read_checkpoint, step_dir
from redline.checkpoint.sharded import load_sharded, save_sharded


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


def test_saving_over_a_directory_of_the_users_refuses_and_leaves_its_files(tmp_path: Path) -> None:
    from redline import Runtime

    results = tmp_path / "results"
    results.mkdir()
    (results / "notes.txt").write_text("a month of notes")
    (tmp_path / "weights.bin").write_bytes(b"other weights")
    with Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        # before, the checkpoint took the directory's place and its files were deleted (a file was swapped away)
        with pytest.raises(CheckpointError, match=r"results is a directory that is not a checkpoint \(no manifest"):
            rt.save(results)
        with pytest.raises(CheckpointError, match=r"weights.bin is a file, which writing a checkpoint there would"):
            rt.save(tmp_path / "weights.bin")
        assert (results / "notes.txt").read_text() == "a month of notes"
        assert (tmp_path / "weights.bin").read_bytes() == b"other weights"
        assert sorted(path.name for path in tmp_path.iterdir()) == ["results", "weights.bin"]  # nothing staged
        rt.save(tmp_path / "checkpoint")
        rt.save(tmp_path / "checkpoint")  # a checkpoint written again is replaced, as before
        (tmp_path / "empty").mkdir()
        rt.save(tmp_path / "empty")
    assert [c.path.name for c in find_checkpoints(tmp_path)] == []  # none of these is a step directory
    assert (tmp_path / "checkpoint" / "manifest.json").is_file() and (tmp_path / "empty" / "manifest.json").is_file()


def test_a_sharded_save_over_a_directory_of_the_users_refuses_and_leaves_its_files(tmp_path: Path) -> None:
    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000001" / "scratch.txt").write_text("the run's own step directory: replaced")
    own = tmp_path / "mine"
    own.mkdir()
    (own / "notes.txt").write_text("kept")
    model, optimizer = _model()
    _save(tmp_path, 1, model, optimizer)
    assert [c.step for c in find_checkpoints(tmp_path)] == [1]
    with pytest.raises(CheckpointError, match=r"mine is a directory that is not a checkpoint .*holds notes.txt\)"):
        save_sharded(own, model, optimizer, runtime_state={}, extra={}, plan={}, step=None)
    assert [path.name for path in own.iterdir()] == ["notes.txt"]


def test_weights_saved_to_a_directory_or_a_new_folder_say_so_or_are_written(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from redline import Runtime

    with Runtime(devices="cpu") as rt:
        model, _ = rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        # before, "Is a directory" came with a hint to free space on the disk
        with pytest.raises(
            CheckpointError, match=r"is a directory: the weights are one file\nhint: pass a file's path"
        ):
            rt.save_weights(tmp_path)
        # before, a folder not made yet was "No such file or directory", with the same hint; a checkpoint's is made
        rt.save_weights(tmp_path / "export" / "model.safetensors")
    saved = load_file(tmp_path / "export" / "model.safetensors")
    assert torch.equal(saved["weight"], model.weight.detach())


def _adam_checkpoint(root: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    _save(root, 1, model, optimizer)
    return step_dir(root, 1)


def test_a_sharded_checkpoint_of_another_optimizer_is_refused_naming_what_it_lacks(tmp_path: Path) -> None:
    checkpoint = read_checkpoint(_adam_checkpoint(tmp_path))
    model = nn.Linear(4, 2)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # before, DCP's CheckpointException (a BaseException) with a traceback: "Missing key in checkpoint state_dict"
    with pytest.raises(CheckpointError) as raised:
        load_sharded(checkpoint, model, optimizer)
    message = str(raised.value)
    assert "the checkpoint's optimizer differs from this run's optimizer: missing from the checkpoint: " in message
    assert "state.weight.momentum_buffer" in message and "keeps exp_avg, exp_avg_sq, step for a parameter" in message
    assert "hint: the run that wrote it built another optimizer" in message
    assert not optimizer.state  # left as it was: no placeholder state from reading the live one
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    options = torch.optim.SGD(model.parameters(), lr=0.1)  # no state to miss: the options it lacks are named
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: param_groups\.0\.momentum"):
        load_sharded(checkpoint, model, options)
    same = torch.optim.Adam(model.parameters(), lr=0.1)
    load_sharded(checkpoint, model, same)  # the optimizer that wrote it loads, as before
    assert int(same.state[model.weight]["step"]) == 1


def test_a_shard_gone_after_the_check_is_a_checkpoint_error_not_dcps_traceback(tmp_path: Path) -> None:
    path = _adam_checkpoint(tmp_path)
    checkpoint = read_checkpoint(path)
    next(path.glob("*.distcp")).unlink()
    model = nn.Linear(4, 2)
    with pytest.raises(CheckpointError, match=r"could not be loaded: rank 0: FileNotFoundError: .*distcp") as raised:
        load_sharded(checkpoint, model, torch.optim.Adam(model.parameters(), lr=0.1))
    assert "hint: if a file of it is gone or damaged, resume from an earlier checkpoint" in str(raised.value)


def test_a_checkpoint_path_that_does_not_exist_says_so_and_names_the_one_it_most_likely_meant(tmp_path: Path) -> None:
    from redline import Runtime
    from redline.checkpoint import open_checkpoint

    with Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.save(step_dir(tmp_path, 100), step=100)
        # before: "not a committed checkpoint (no readable manifest.json: [Errno 2] No such file or directory: ...)"
        with pytest.raises(CheckpointError) as raised:
            rt.load(tmp_path / "step-0000100")  # a digit short
    assert str(raised.value) == (
        f"{tmp_path / 'step-0000100'}: no such checkpoint: nothing is there\n"
        f"hint: did you mean {step_dir(tmp_path, 100)}?"
    )
    with pytest.raises(CheckpointError, match=r"nowhere: no such checkpoint: nothing is there\nhint: pass a directory"):
        open_checkpoint(str(tmp_path / "run" / "nowhere"), tmp_path)


def test_a_model_the_user_compiled_saves_under_its_own_names_and_loads_either_way(tmp_path: Path) -> None:
    """Before, torch.compile(model)'s wrapper wrote every name with `_orig_mod.` before it: the checkpoint was
    refused by the plain model as another model's, and the weights file loaded into nothing but a compiled one."""
    from safetensors.torch import load_model, save_file

    from redline import Runtime
    from redline.checkpoint import Checkpoint
    from redline.checkpoint.whole import FORMAT, load_weights

    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    with Runtime(devices="cpu", compile="off") as rt:
        rt.setup(torch.compile(net), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.save(tmp_path / "checkpoint")
        rt.save_weights(tmp_path / "model.safetensors")
    plain = nn.Linear(4, 2)
    load_model(plain, str(tmp_path / "model.safetensors"))  # strict: under the plain model's names
    assert torch.equal(plain.weight, net.weight)
    for compiled in (False, True):
        model = nn.Linear(4, 2)
        with Runtime(devices="cpu", compile="off") as rt:
            rt.setup(torch.compile(model) if compiled else model, lambda params: torch.optim.SGD(params, lr=0.1))
            rt.load(tmp_path / "checkpoint")
        assert torch.equal(model.weight, net.weight), compiled
    # weights an earlier version wrote under the wrapper's names still load into a compiled model
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    save_file(
        {f"_orig_mod.{name}": t.detach() for name, t in net.state_dict().items()}, str(earlier / "model.safetensors")
    )
    model = nn.Linear(4, 2)
    load_weights(Checkpoint(earlier, 1, {"format": FORMAT, "files": {}}), torch.compile(model))
    assert torch.equal(model.weight, net.weight)


def test_loading_a_file_of_a_checkpoint_names_its_directory(tmp_path: Path) -> None:
    """Before: "not a committed checkpoint (no readable manifest.json: [Errno 20] Not a directory: ...)"."""
    from redline import Runtime

    with Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.save(tmp_path / "checkpoint")
        with pytest.raises(CheckpointError) as raised:
            rt.load(tmp_path / "checkpoint" / "model.safetensors")
        assert str(raised.value) == (
            f"{tmp_path / 'checkpoint' / 'model.safetensors'}: a file, where a checkpoint is a directory holding a "
            f"manifest.json\nhint: pass the checkpoint directory itself, e.g. {tmp_path / 'checkpoint'}"
        )
        (tmp_path / "notes.txt").write_text("")
        with pytest.raises(CheckpointError, match=r"notes.txt: a file, where .*\nhint: pass a directory step-"):
            rt.load(tmp_path / "notes.txt")


def test_a_checkpoint_where_a_file_is_in_the_way_or_nothing_may_be_written_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the system's FileExistsError or PermissionError came out as a traceback."""
    from redline import Runtime

    (tmp_path / "notes.txt").write_text("kept")
    model, optimizer = _model()
    with Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        with pytest.raises(CheckpointError, match=r"notes.txt/ckpt: the checkpoint cannot go there: File exists"):
            rt.save(tmp_path / "notes.txt" / "ckpt")
    with pytest.raises(CheckpointError, match=r"hint: pass a path in a directory you can write to \(a file is in"):
        save_sharded(tmp_path / "notes.txt" / "ckpt", model, optimizer, runtime_state={}, extra={}, plan={}, step=1)
    assert (tmp_path / "notes.txt").read_text() == "kept"
    mkdir = Path.mkdir

    def read_only(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.name.startswith(".tmp-"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(CheckpointError) as raised:
        _save(tmp_path, 1, model, optimizer)
    assert str(raised.value).startswith(f"{step_dir(tmp_path, 1)}: the checkpoint could not be written: Permission")
    assert "(or make it writable again)" in str(raised.value)


def _runtime_run(optimizer: Any) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    import redline

    rt = redline.Runtime(devices="cpu", compile="off", precision="fp32")
    torch.manual_seed(0)
    model, built = rt.setup(nn.Linear(4, 2), optimizer)
    rt.backward(model(torch.randn(8, 4)).pow(2).mean())
    rt.step(built)
    return rt, model, built


def test_a_whole_checkpoint_of_another_optimizer_is_refused_before_anything_loads(tmp_path: Path) -> None:
    """Adam's state loaded into SGD with momentum: torch took it, and the first step failed with KeyError 'momentum'."""
    rt, _, _ = _runtime_run(lambda params: torch.optim.Adam(params, lr=1e-3))
    rt.save(tmp_path / "step-00000001")
    other, model, sgd = _runtime_run(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    weights, state = {k: v.clone() for k, v in model.state_dict().items()}, sgd.state_dict()
    refused = r"optimizer differs from this run's \(SGD\): it has options .*betas.* where this one has .*momentum"
    with pytest.raises(CheckpointError, match=refused + r"(.|\n)*hint: the run that wrote it built another optimizer"):
        other.load(tmp_path / "step-00000001")
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())  # nothing was loaded
    assert sgd.state_dict()["param_groups"] == state["param_groups"]
    same, _, _ = _runtime_run(lambda params: torch.optim.Adam(params, lr=1e-3))
    same.load(tmp_path / "step-00000001")  # the optimizer that wrote it loads as ever
