"""Check benchmarks/scaling.md against a real 2-process run: traffic per step and state per rank.

Run under the launcher; rank 0 prints a markdown table (and writes it with --write NAME):

    python -m redline launch --nproc 2 benchmarks/scaling_check.py [--strategy ddp|fsdp] [--write NAME]
    python -m redline launch --nproc 1 benchmarks/scaling_check.py --strategy fsdp   # one rank

DDP: a communication hook counts the bytes of every gradient bucket it all-reduces, then all-reduces
it as DDP would; the formula is every parameter's gradient once per step, 4 bytes each in fp32.

FSDP2: the all-gathers and reduce-scatters FSDP2 issues are counted by wrapping torch.distributed's
collective functions for the run, and each rank's share of the weights, gradients and Adam state is
read off its local shards. The formulas: the forward all-gathers every weight, the backward again
those of the blocks resharded after forward (all but the last block and the root, redline's choice;
none on one rank, where resharding frees nothing), the gradients are reduce-scattered once; each
rank holds 1/N of every state. Every collective is counted as well as its bytes: each call pays a
launch and a latency whatever its size.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.

import argparse
import functools
import inspect
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import redline
from redline.parallel.blocks import find_blocks

# The names FSDP2 calls through torch.distributed (torch 2.13 uses the *_single ones, older the others).
GATHERS = ("all_gather_single", "all_gather_into_tensor")
SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="example:chargpt")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--write", default=None)
    args = parser.parse_args()
    task = redline.load_task(args.task)
    rt = redline.Runtime(devices="cpu", precision="fp32", compile="off", seed=0, strategy=args.strategy).start()
    plain = task.build_model()  # after the seed
    params = sum(p.numel() for p in plain.parameters())
    blocks = [block for _, block in find_blocks(plain, layers=True)]  # the blocks FSDP shards
    model, optimizer = rt.setup(plain, task.optimizer)
    world = dist.get_world_size()
    resharded = blocks[:-1] if world > 1 else []  # the strategy reshards only where it frees memory
    regathered = sum(p.numel() for block in resharded for p in block.parameters())
    units = len(blocks) + 1  # each block and the root: one all-gather and one reduce-scatter each
    counted: Counter[str] = Counter()
    if args.strategy == "ddp":

        def counting_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            counted["all-reduce"] += bucket.buffer().numel() * bucket.buffer().element_size()
            counted["buckets"] += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_hook)  # type: ignore[operator]
    else:
        count_collectives(counted)
        count_unshards(counted)
    loader = rt.setup_loader(torch.utils.data.DataLoader(task.train_data, batch_size=task.batch_size, shuffle=True))
    for step, (inputs, targets) in enumerate(loader):
        with rt.autocast():
            loss = task.loss_fn(model(inputs), targets)
        rt.backward(loss)
        rt.step(optimizer)
        if step + 1 == args.steps:
            break
    per_step = {name: value / args.steps for name, value in counted.items()}
    head = [
        f"Task `{args.task}`, {params:,} parameters, {world} processes (gloo), {args.steps} steps, fp32, "
        f"strategy {rt.explain().strategy.value}; started by `python -m redline launch --nproc {world}`.",  # type: ignore[union-attr]
        "",
        "| figure | formula | measured |",
        "| --- | --- | --- |",
    ]
    if args.strategy == "ddp":
        rows = ddp_rows(params, world, per_step)
    else:
        rows = fsdp_rows(params, regathered, world, per_step, model, optimizer)
        if world > 1:
            gathers = f"{units} units in forward + {len(resharded)} re-gathered = {units + len(resharded)}"
            scatters = f"{units} units"
        else:  # FSDP2 (torch 2.13) copies each parameter in and out instead of calling a collective
            gathers = scatters = "none on one rank (a copy per parameter instead) = 0"
        rows.append(f"| all-gathers per step | {gathers} | {per_step.get('all-gather calls', 0):.0f} |")
        rows.append(f"| reduce-scatters per step | {scatters} | {per_step.get('reduce-scatter calls', 0):.0f} |")
        rows.append(
            f"| units unsharded per step (gathered, or on one rank copied in) | {units} in forward + "
            f"{len(resharded)} in backward = {units + len(resharded)} | {per_step.get('unshards', 0):.0f} "
            f"({per_step.get('parameters unsharded', 0):.0f} parameter tensors) |"
        )
    if dist.get_rank() == 0:
        import environment  # benchmarks/ is on sys.path when run as a script

        environment.publish(args.write, f"Scaling check: {args.strategy.upper()} on {world} processes", head + rows)
    dist.barrier()
    rt.close()


def ddp_rows(params: int, world: int, per_step: dict[str, float]) -> list[str]:
    expected = params * 4
    measured = per_step["all-reduce"]
    ring = 2 * (world - 1) / world
    return [
        f"| bytes all-reduced per step | 4 x params = {expected:,} | {measured:,.0f} |",
        f"| bytes each rank sends per step (ring) | 2(N-1)/N x 4 x params = {ring * expected:,.0f} "
        f"| {ring * measured:,.0f} (from the measured buckets) |",
        f"| all-reduces (gradient buckets) per step | 1 MiB first, then 25 MiB each = {ddp_buckets(expected)} "
        f"| {per_step['buckets']:.0f} |",
    ]


def ddp_buckets(grad_bytes: int) -> int:
    """DDP's buckets: the first capped at 1 MiB (so the first all-reduce starts early), then 25 MiB."""
    first, rest = 1 << 20, 25 << 20
    return 1 + -(-max(0, grad_bytes - first) // rest)


def fsdp_rows(
    params: int, regathered: int, world: int, per_step: dict[str, float], model: Any, optimizer: Any
) -> list[str]:
    gathered = 4 * (params + regathered) if world > 1 else 0  # one rank: no collective at all (see below)
    scattered = 4 * params if world > 1 else 0
    ring = (world - 1) / world
    local = {
        "weights": sum(local_bytes(p) for p in model.parameters()),
        "gradients": sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
        "Adam moments": sum(
            local_bytes(value) for state in optimizer.state.values() for key, value in state.items() if key != "step"
        ),
    }
    totals = {name: all_ranks(value) for name, value in local.items()}
    gather_formula = f"4 x (params + re-gathered {regathered:,})" if world > 1 else "none on one rank"
    scatter_formula = "4 x params" if world > 1 else "none on one rank"
    rows = [
        f"| bytes all-gathered per step (output) | {gather_formula} = {gathered:,} "
        f"| {per_step.get('all-gather', 0):,.0f} |",
        f"| bytes reduce-scattered per step (input) | {scatter_formula} = {scattered:,} "
        f"| {per_step.get('reduce-scatter', 0):,.0f} |",
        f"| bytes each rank sends per step (ring) | (N-1)/N x both = {ring * (gathered + scattered):,.0f} "
        f"| {ring * (per_step.get('all-gather', 0) + per_step.get('reduce-scatter', 0)):,.0f} |",
    ]
    for name, factor in (("weights", 4), ("gradients", 4), ("Adam moments", 8)):
        rows.append(
            f"| {name} held by rank 0 | {factor} x params / N = {factor * params / world:,.0f} "
            f"| {local[name]:,} (all ranks together: {totals[name]:,}) |"
        )
    return rows


def count_collectives(counted: Counter[str]) -> None:
    """Wrap torch.distributed's all-gather and reduce-scatter to add up their full-size bytes."""
    depth = [0]  # one collective may call another name for the same work: count the outermost

    def wrap(function: Callable[..., Any], kind: str, full: str) -> Callable[..., Any]:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def counting(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                tensor = signature.bind(*args, **kwargs).arguments[full]
                counted[kind] += tensor.numel() * tensor.element_size()
                counted[f"{kind} calls"] += 1
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counting

    for name in GATHERS:  # the output is the full size
        if hasattr(dist, name):
            setattr(dist, name, wrap(getattr(dist, name), "all-gather", "output_tensor"))
    for name in SCATTERS:  # the input is the full size
        if hasattr(dist, name):
            setattr(dist, name, wrap(getattr(dist, name), "reduce-scatter", "input"))


def count_unshards(counted: Counter[str]) -> None:
    """Count FSDP2's unshards (a private class of torch's; this benchmark alone reaches for it)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    real = FSDPParamGroup.wait_for_unshard

    def counting(self: Any) -> Any:
        if self._all_gather_result is not None:  # an unshard that was issued and is now completed
            counted["unshards"] += 1
            counted["parameters unsharded"] += len(self.fsdp_params)
        return real(self)

    FSDPParamGroup.wait_for_unshard = counting  # type: ignore[method-assign]


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def all_ranks(value: int) -> int:
    total = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total.item())


if __name__ == "__main__":
    main()
