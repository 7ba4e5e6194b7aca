"""What the per-step stop vote costs a training step: the time ``StopVote.vote`` holds the loop.

Run under the launcher; rank 0 prints a markdown table (and writes it with --write NAME):

    python -m redline launch --nproc 2 benchmarks/stop_vote.py [--steps 2000] [--write NAME]

Each "step" is a matmul loop of about --work-ms milliseconds; the vote is posted after it, as the
Trainer does, and the time inside ``vote()`` is measured: posting an asynchronous all-reduce and
reading the previous one's result. The same steps without a vote give the step time to compare.
Measured twice: voting every step (before the Trainer knows the step time) and paced as the
Trainer paces it (a vote about every 0.2 s).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from redline.parallel.collectives import StopVote
from redline.runtime.runtime import Runtime


def work(a: torch.Tensor, ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        a @ a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--work-ms", type=float, default=2.0)
    parser.add_argument("--write", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rt = Runtime(devices="cpu").start()  # joins the process group the launcher set up
    a = torch.randn(64, 64)
    rows = []
    for paced in (False, True):
        vote = StopVote()
        if paced:
            vote.pace(args.work_ms / 1000)  # the Trainer paces by the all-reduced mean step time
        inside, with_vote, without = [], [], []
        for step in range(1, args.steps + 1):
            dist.barrier()  # the ranks in step, as the gradient collectives keep them in training
            start = time.perf_counter()
            work(a, args.work_ms)
            before = time.perf_counter()
            vote.vote(False, step)
            done = time.perf_counter()
            inside.append(1e6 * (done - before))
            with_vote.append(done - start)
            dist.barrier()
            start = time.perf_counter()
            work(a, args.work_ms)
            without.append(time.perf_counter() - start)
        vote.close()
        label = f"every {vote.every} steps (paced)" if paced else "every step"
        ratio = statistics.mean(with_vote) / statistics.mean(without)
        rows.append(f"| {label} | {statistics.mean(inside):.1f} us | {max(inside):.0f} us | {ratio:.4f} |")
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        body = [
            f"{world} processes (gloo), {args.steps} steps of ~{args.work_ms} ms of matmuls each, rank 0's "
            f"figures; started by `python -m redline launch --nproc {world}`.",
            "",
            "| vote | time in vote() per step, mean | longest | mean step with vote / without |",
            "| --- | --- | --- | --- |",
            *rows,
        ]
        import environment  # benchmarks/ is on sys.path when run as a script

        environment.publish(args.write, f"Stop vote cost on {world} processes", body)
    rt.close()


if __name__ == "__main__":
    main()
