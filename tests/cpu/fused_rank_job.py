"""One rank of a two-process job whose ranks would each time the optimizer's fused kernel differently.

Run by test_fused_ranks.py as ``python fused_rank_job.py OUT`` with RANK and WORLD_SIZE set: rank 0's timing finds
fused faster, rank 1's slower; writes the implementation this rank's Plan chose, and whether its optimizer is fused,
to OUT/rank{R}.txt.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import redline.runtime.fused as fused
from redline import Runtime, RuntimeOptions
from redline.parallel.env import read_env
from redline.plan.optimizer import StepTiming


def main() -> None:
    out = Path(sys.argv[1])
    env = read_env()
    torch.set_num_threads(1)
    store = dist.FileStore(str(out / "store"), env.world_size)
    dist.init_process_group(
        "gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=dt.timedelta(seconds=30)
    )
    fused_ms = 0.3 if env.rank == 0 else 3.0  # each rank, left to itself, would choose otherwise
    fused.time_fused = lambda optimizer: StepTiming(given_s=1e-3, fused_s=fused_ms / 1e3, timed=10, of=10)
    model = nn.Linear(4, 2)
    with Runtime(RuntimeOptions(devices="cpu")) as rt:
        _, optimizer = rt.setup(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
        chosen = rt.explain().optimizer.value
    (out / f"rank{env.rank}.txt").write_text(f"{chosen} {bool(optimizer.defaults.get('fused'))}")
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
