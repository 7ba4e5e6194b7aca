"""On a GPU held to a smaller card's memory: the predicted largest batch, the one found by running, and a recovery.

The GPU's allocator is capped at ``--mem-gib`` (torch.cuda.set_per_process_memory_fraction), so an
H200 behaves like a 24 GB card. A GPT-2-small-shaped chargpt with a long context fills it. Three
things are recorded, in one run:
1. the largest batch ``estimate_memory`` predicts to fit the cap (the trace's line search of
   ``redline memory``, against the cap itself: the fraction leaves the CUDA context out);
2. the largest batch ``find_batch_size`` finds by running two bf16 training steps per size;
3. out-of-memory recovery: a Runtime with ``micro_batch="auto"`` given a batch twice that size
   runs three steps; each step's loss, the micro-batch it settled on, and the allocator's peak.

    python benchmarks/memory_fit.py [--device cuda|cpu] [--mem-gib 24] [--write memory-fit-cuda]

On a CPU (a dry run of the script) nothing runs out of memory: the search stops at a cap and the
recovery runs whole.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import environment
from redline.examples.chargpt import chargpt
from redline.memory.estimate import estimate_memory
from redline.memory.fit import largest_batch
from redline.memory.search import find_batch_size, real_batch
from redline.runtime.options import RuntimeOptions
from redline.runtime.runtime import Runtime

GIB = 2**30
PRECISION = "bf16-mixed"


def long_context_task(device: str) -> object:
    if device == "cuda":  # GPT-2 small's shape at twice its context
        return chargpt(n_layer=12, n_head=12, n_embd=768, block_size=2048, batch_size=4)
    return chargpt(n_layer=2, n_head=2, n_embd=64, block_size=256, batch_size=4, max_chars=60_000)


def predicted(task, limit: int, device: str) -> tuple[int | None, float]:
    began = time.perf_counter()
    first = estimate_memory(task, batch_size=task.batch_size, precision=PRECISION, target=device)

    def at(batch_size: int):
        return estimate_memory(task, batch_size=batch_size, precision=PRECISION, target=device)

    return largest_batch(at, first, limit), time.perf_counter() - began


def recover(task, size: int, device: str) -> dict[str, object]:
    """Three steps at ``size`` under micro_batch='auto'; what each settled on."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses = []
    began = time.perf_counter()
    with Runtime(RuntimeOptions(devices=device, precision=PRECISION, micro_batch="auto", compile="off")) as rt:
        model, optimizer = rt.setup(task.build_model(), task.optimizer)
        batch, _ = real_batch(task.train_data, size)
        batch = rt.to_device(batch)

        def loss_of(part):
            inputs, targets = part
            return task.loss_fn(model(inputs), targets)

        for _ in range(3):
            losses.append(float(rt.train_step(loss_of, batch)))
            rt.step(optimizer)
        events = [(e.step, e.from_size, e.to_size, e.where) for e in rt.oom_events]
        micro = rt.explain().to_dict()["micro_batch"]
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return {"losses": losses, "events": events, "micro": micro, "peak": peak, "seconds": time.perf_counter() - began}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--mem-gib", type=float, default=24.0)
    parser.add_argument("--write", metavar="NAME", help="also write benchmarks/results/NAME.md")
    args = parser.parse_args(argv)
    task = long_context_task(args.device)
    limit = int(args.mem_gib * GIB)
    cap = None
    if args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
    else:
        cap = 16  # a CPU's out-of-memory kills the process: the dry run stops at a cap
    guess, guess_s = predicted(task, limit, args.device)
    print(f"predicted largest batch: {guess} ({guess_s:.1f} s of tracing)", flush=True)
    search = find_batch_size(task, options=RuntimeOptions(devices=args.device, precision=PRECISION), max_batch_size=cap)
    print(f"measured largest batch: {search.largest} ({search.seconds:.1f} s): {search.reason}", flush=True)
    double = 2 * (search.largest or 1)
    run = recover(task, double, args.device)
    print(f"recovery at batch {double}: {run}", flush=True)
    tried = ", ".join(f"{size}{'' if ok else ' (OOM)'}" for size, ok, _ in search.tried)
    peak = "n/a" if run["peak"] is None else f"{run['peak'] / GIB:.2f} GiB"
    error = guess / search.largest - 1 if guess and search.largest else math.nan
    lines = [
        f"Task: {task.name} at {'GPT-2 small' if args.device == 'cuda' else 'a small'} shape with a long context "
        f"(see the script), {PRECISION}, AdamW; allocator capped at {args.mem_gib:g} GiB"
        f"{'' if args.device == 'cuda' else ' (not on a CPU: a dry run of the script, the comparison meaningless)'}.",
        "",
        "| what | result |",
        "| --- | --- |",
        f"| largest batch predicted (estimate_memory, {guess_s:.1f} s of tracing) | {guess} |",
        f"| largest batch measured (find_batch_size, {search.seconds:.1f} s) | {search.largest} |",
        f"| predicted vs measured | {error:+.1%} |",
        f"| sizes tried, in order | {tried} |",
        f"| recovery: batch given | {double} |",
        f"| recovery: out-of-memory events (step, from, to, where) | {run['events'] or 'none'} |",
        f"| recovery: micro-batch in the Plan | {run['micro']['value']}: {run['micro']['reason']} |",
        f"| recovery: losses of the 3 steps | {', '.join(f'{x:.4f}' for x in run['losses'])} |",
        f"| recovery: allocator peak | {peak} |",
        f"| recovery: seconds for 3 steps | {run['seconds']:.1f} |",
    ]
    environment.publish(args.write, "Largest batch and out-of-memory recovery on a capped GPU", lines, args.device)


if __name__ == "__main__":
    main()
