"""A load names the optimizer options it changed to the checkpoint's, and those the optimizer sets back to its own as
it loads (AdamW's decoupled_weight_decay from an Adam's checkpoint): the warning says what the run goes on with."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import redline


def run(path: Path, optimizer: type[torch.optim.Optimizer], *, lr: float, save: bool) -> torch.optim.Optimizer:
    with redline.Runtime(devices="cpu", compile="off", seed=0) as rt:
        _, built = rt.setup(nn.Linear(4, 2), lambda params: optimizer(params, lr=lr, weight_decay=0.1))
        if save:
            built.step()
            rt.save(path)
        else:
            rt.load(path)
    return built


def test_an_option_the_optimizer_sets_as_it_loads_is_said_to_be_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Said to go on with the checkpoint's decoupled_weight_decay False, where AdamW's load set it True
    run(tmp_path / "adam", torch.optim.Adam, lr=0.01, save=True)
    with caplog.at_level(logging.WARNING, logger="redline"):
        adamw = run(tmp_path / "adam", torch.optim.AdamW, lr=0.02, save=False)
    assert adamw.param_groups[0]["decoupled_weight_decay"] is True and adamw.param_groups[0]["lr"] == 0.01
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith(
        f"{tmp_path / 'adam'}: this run's optimizer has lr 0.02, the checkpoint's 0.01, and goes on with the "
        "checkpoint's: loading restores the optimizer as it was saved; decoupled_weight_decay True, the checkpoint's "
        "False: AdamW sets its own as it loads, and goes on with it\nhint: "
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="redline"):
        run(tmp_path / "adam", torch.optim.AdamW, lr=0.01, save=False)
    assert (
        caplog.records[0]
        .getMessage()
        .startswith(
            f"{tmp_path / 'adam'}: this run's optimizer has decoupled_weight_decay True, the checkpoint's False: AdamW "
            "sets its own as it loads"
        )
    )


def test_a_checkpoint_written_after_the_load_records_the_options_the_run_trained_with(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run(tmp_path / "adam", torch.optim.Adam, lr=0.01, save=True)
    with redline.Runtime(devices="cpu", compile="off", seed=0) as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1))
        rt.load(tmp_path / "adam")
        rt.save(tmp_path / "adamw")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="redline"):
        run(tmp_path / "adamw", torch.optim.AdamW, lr=0.01, save=False)
    assert caplog.records == []
