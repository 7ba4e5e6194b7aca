"""Check benchmarks/scaling.md against a real 2-process run: the bytes DDP all-reduces per step.

Run under the launcher; rank 0 prints a markdown table (and writes it with --write NAME):

    python -m redline launch --nproc 2 benchmarks/scaling_check.py [--task-arg n_layer=2 ...] [--write NAME]

A DDP communication hook counts the bytes of every gradient bucket it all-reduces, then all-reduces
it as DDP would. The count is compared with the formula: every parameter's gradient once per step,
4 bytes each in fp32. The FSDP figures (each rank's shard) are checked where the strategy runs.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import redline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="example:chargpt")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--write", default=None)
    args = parser.parse_args()
    task = redline.load_task(args.task)
    rt = redline.Runtime(devices="cpu", precision="fp32", compile="off", seed=0)
    model, optimizer = rt.setup(task.build_model(), task.optimizer)
    counted: list[int] = []

    def counting_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        counted.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)  # type: ignore[operator]
    loader = rt.setup_loader(torch.utils.data.DataLoader(task.train_data, batch_size=task.batch_size, shuffle=True))
    for step, (inputs, targets) in enumerate(loader):
        with rt.autocast():
            loss = task.loss_fn(model(inputs), targets)
        rt.backward(loss)
        rt.step(optimizer)
        if step + 1 == args.steps:
            break
    world = dist.get_world_size()
    params = sum(p.numel() for p in model.parameters())
    per_step = sum(counted) / args.steps
    expected = params * 4
    sent = 2 * (world - 1) / world * per_step  # ring all-reduce: each rank sends (and receives) this much
    ring = 2 * (world - 1) / world * expected
    if dist.get_rank() == 0:
        body = [
            f"Task `{args.task}`, {params:,} parameters, {world} processes (gloo), {args.steps} steps, fp32.",
            "",
            "| figure | formula | measured |",
            "| --- | --- | --- |",
            f"| bytes all-reduced per step | 4 x params = {expected:,} | {per_step:,.0f} |",
            f"| bytes each rank sends per step (ring) | 2(N-1)/N x 4 x params = {ring:,.0f} "
            f"| {sent:,.0f} (from the measured buckets) |",
            f"| gradient buckets per step | - | {len(counted) / args.steps:.0f} |",
        ]
        print("\n".join(body))
        if args.write:
            import environment  # benchmarks/ is on sys.path when run as a script

            print(f"wrote {environment.write(args.write, 'Scaling check: DDP traffic on 2 processes', body)}")
    dist.barrier()


if __name__ == "__main__":
    main()
