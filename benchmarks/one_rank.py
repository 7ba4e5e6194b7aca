"""The distributed path on one rank, against the plain loop: what DDP and FSDP2 add to a step, before and after.

    python benchmarks/one_rank.py [--task example:chargpt] [--rounds 15] [--steps 10] [--write NAME]

One process joins a one-rank gloo group and trains the same model five ways, interleaved in rounds
so the machine's drift falls on all alike: the plain loop; DDP as redline wrapped it before
(gradients copied into and out of the buckets) and now (``gradient_as_bucket_view``); FSDP2 as
before (blocks resharded after forward and gathered again in backward) and now (on one rank the
blocks stay gathered, and each block's forward prefetches the next). Every variant takes the same
batches; each round's mean step is divided by the plain loop's in the same round, and the median
and middle half of those ratios are reported.
"""

from __future__ import annotations

import argparse
import copy
import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import environment
import redline
from redline.parallel.fsdp import shard


def variants(model: nn.Module) -> dict[str, nn.Module]:
    return {
        "plain": copy.deepcopy(model),
        "DDP before": DistributedDataParallel(copy.deepcopy(model)),
        "DDP now": DistributedDataParallel(copy.deepcopy(model), gradient_as_bucket_view=True),
        "FSDP2 before": _fsdp(copy.deepcopy(model), reshard=True, prefetch=False),
        "FSDP2 kept gathered": _fsdp(copy.deepcopy(model), reshard=False, prefetch=False),
        "FSDP2 prefetch": _fsdp(copy.deepcopy(model), reshard=True, prefetch=True),
        "FSDP2 now": shard(copy.deepcopy(model), precision="fp32", reshard=False),
    }


def _fsdp(model: nn.Module, *, reshard: bool, prefetch: bool) -> nn.Module:
    """FSDP2 with each of the two changes on or off (before: resharded, no explicit prefetch)."""
    from redline.parallel import fsdp

    real = fsdp._prefetch_in_order
    if not prefetch:
        fsdp._prefetch_in_order = lambda blocks: None
    try:
        return shard(model, precision="fp32", reshard=reshard)
    finally:
        fsdp._prefetch_in_order = real


def round_of(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any], loss_fn: Callable) -> float:
    start = time.perf_counter()
    for inputs, targets in batches:
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="example:chargpt")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--write", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        dist.init_process_group("gloo", init_method=f"file://{Path(scratch) / 'store'}", rank=0, world_size=1)
        task = redline.load_task(args.task)
        torch.manual_seed(0)
        models = variants(task.build_model())
        optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
        loader = torch.utils.data.DataLoader(task.train_data, batch_size=task.batch_size, shuffle=False)
        batches = [batch for _, batch in zip(range(args.steps), loader, strict=False)]
        times: dict[str, list[float]] = {name: [] for name in models}
        for round_index in range(args.rounds + 1):
            for name, model in models.items():
                seconds = round_of(model, optimizers[name], batches, task.loss_fn)
                if round_index:  # the first round warms every variant up
                    times[name].append(seconds)
        del models, optimizers
        gc.collect()
        dist.destroy_process_group()
    rows = []
    for name, values in times.items():
        ratios = sorted(a / b for a, b in zip(values, times["plain"], strict=True))
        quartiles = f"{ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f}"
        rows.append(
            f"| {name} | {1e3 * environment.median(values):.2f} ms | {environment.median(ratios):.3f} | {quartiles} |"
        )
    body = [
        f"Task `{args.task}`, one rank (gloo, CPU), {args.rounds} rounds of {args.steps} steps per variant, "
        "interleaved; each round's mean step over the plain loop's in the same round.",
        "",
        "| loop | step (median) | / plain, median of the rounds | middle half of the rounds |",
        "| --- | --- | --- | --- |",
        *rows,
    ]
    environment.publish(args.write, "The distributed path on one rank", body)


if __name__ == "__main__":
    main()
