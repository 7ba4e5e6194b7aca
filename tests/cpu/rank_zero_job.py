"""One rank of a two-process job whose model factory fails on rank 0 only, during a lookup rank 0 does for all.

Run by test_rank_zero_lookups.py as ``python rank_zero_job.py OUT tuned|trial`` with RANK and WORLD_SIZE
set; writes what this rank raised to OUT/rank{R}.txt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset
from two_ranks import join_group

import redline
import redline.runtime.measure as measure
from redline.runtime.options import RuntimeOptions
from redline.runtime.tuned_run import find_tuned


def broken_on_rank0() -> nn.Module:
    if dist.get_rank() == 0:
        raise KeyError("rank zero's config")
    return nn.Linear(4, 2)


def main() -> None:
    out, lookup = Path(sys.argv[1]), sys.argv[2]
    env = join_group(out, timeout_s=20)
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    task = redline.Task(model=broken_on_rank0, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8)
    options = RuntimeOptions(devices="cpu")
    try:
        if lookup == "tuned":
            find_tuned(task, options, 8, env)
        else:
            measure.fast_precisions = lambda facts: ["bf16-mixed"]  # a candidate on every CPU: the trial runs
            measure.measure_auto(task, options, 8, 1000, env, trial="on")
        result = "returned"
    except Exception as exc:  # what this rank was told, for the test to read
        result = f"{type(exc).__name__}: {exc}"
    (out / f"rank{env.rank}.txt").write_text(result)
    os._exit(0)  # no goodbye collective: a rank 0 that failed takes part in nothing more


if __name__ == "__main__":
    main()
