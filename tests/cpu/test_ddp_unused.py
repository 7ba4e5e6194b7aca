"""DDP with find_unused_parameters: a model whose ranks and steps use different parameters trains correctly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from ddp_unused_job import STEPS, batch, head_for, initial, sgd

JOB = Path(__file__).with_name("ddp_unused_job.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference() -> dict[str, torch.Tensor]:
    """One process, the two ranks' losses averaged: the gradient DDP's all-reduce gives (zero where a rank
    left a parameter unused)."""
    model = initial()
    optimizer = sgd(model.parameters())
    for step in range(STEPS):
        losses = []
        for rank in range(2):
            inputs, targets = batch(rank, step)
            losses.append(nn.functional.cross_entropy(model(inputs, head_for(rank, step)), targets))
        (sum(losses) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp-unused")
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        }  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(JOB), str(out)], env=env, stderr=subprocess.PIPE))
    errors = [p.communicate(timeout=180)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(errors)[-4000:]
    return out


@pytest.mark.parametrize("run", ["runtime", "local"])
def test_every_rank_ends_with_the_weights_of_the_averaged_gradients(trained, run):
    expected = reference()
    for rank in range(2):
        got = torch.load(trained / f"{run}-rank{rank}.pt")
        for name, value in expected.items():
            assert torch.allclose(got[name], value, atol=1e-6), f"rank {rank}: {name} differs"
    assert not torch.equal(expected["heads.1.weight"], initial().state_dict()["heads.1.weight"])  # it did train


def test_the_plan_says_unused_parameters_are_searched_for(trained):
    assert "find_unused_parameters" in (trained / "strategy.txt").read_text()
