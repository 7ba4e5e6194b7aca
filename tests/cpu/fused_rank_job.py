"""One rank of a two-process job whose ranks would each time the optimizer's fused kernel differently.

Run by test_fused_ranks.py as ``python fused_rank_job.py OUT MODE`` with RANK and WORLD_SIZE set: rank 0's timing
finds fused faster, rank 1's slower; with MODE ``stepped0`` or ``stepped1`` that rank's optimizer has stepped before
setup (it cannot be rebuilt). Writes the implementation this rank's Plan chose and whether its optimizer is fused,
or the error it raised, to OUT/rank{R}.txt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from two_ranks import join_group

import redline.runtime.fused as fused
from redline import Runtime, RuntimeOptions
from redline.plan.optimizer import StepTiming


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    env = join_group(out, timeout_s=30)
    torch.set_num_threads(1)
    fused_ms = 0.3 if env.rank == 0 else 3.0  # each rank, left to itself, would choose otherwise
    fused.time_fused = lambda optimizer: StepTiming(given_s=1e-3, fused_s=fused_ms / 1e3, timed=10, of=10)
    model = nn.Linear(4, 2)
    given = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode == f"stepped{env.rank}":
        model(torch.randn(2, 4)).sum().backward()
        given.step()
    try:
        with Runtime(RuntimeOptions(devices="cpu")) as rt:
            _, optimizer = rt.setup(model, given)
            result = f"{rt.explain().optimizer.value} {bool(optimizer.defaults.get('fused'))}"
    except Exception as exc:  # what this rank was told, for the test to read
        result = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    (out / f"rank{env.rank}.txt").write_text(result)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
