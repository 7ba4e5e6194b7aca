"""A loop of your own under `redline launch`, with rt.train_step, where one rank runs out of memory.

    python oom_job.py OUT [--micro-batch auto|N] [--fail-rank R] [--kind forward|backward] [--steps S]
                      [--strategy auto|ddp|fsdp]

Rank R's model runs out of memory above 5 samples (the others never do); every rank takes 16
samples of each global batch of 32. Each rank writes OUT/rank{R}.json (its out-of-memory events,
the Plan's micro_batch axis, the batch sizes its forward ran) and OUT/weights-rank{R}.pt (not under
FSDP: its parameters are shards); rank 0 writes the whole weights to OUT/model.safetensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch
from oom_models import make_data, make_model
from torch import nn
from torch.utils.data import DataLoader

import redline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--micro-batch", default="auto")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--kind", default="forward")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--strategy", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    options = redline.RuntimeOptions(devices="cpu", compile="off", seed=0, micro_batch=args.micro_batch)
    with redline.Runtime(options, strategy=args.strategy) as rt:
        model = make_model(args.kind, limit=5 if rank == args.fail_rank else None)
        wrapped, optimizer = rt.setup(model, lambda params: torch.optim.AdamW(params, lr=1e-2))
        loader = rt.setup_loader(DataLoader(make_data(args.steps * 32), batch_size=32))

        def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return nn.functional.cross_entropy(wrapped(batch[0]), batch[1])

        for inputs, targets in loader:
            rt.train_step(loss_of, (inputs, targets))
            rt.step(optimizer)
        micro = rt.explain().micro_batch
        assert micro is not None
        found = {
            "events": [dataclasses.asdict(e) for e in rt.oom_events],
            "micro_batch": {"value": micro.value, "reason": micro.reason},
            "sizes": model.sizes,
        }
        (out / f"rank{rank}.json").write_text(json.dumps(found, default=str))
        rt.save_weights(out / "model.safetensors")  # collective: gathered from the shards under FSDP
        if args.strategy != "fsdp":
            torch.save(model.state_dict(), out / f"weights-rank{rank}.pt")


if __name__ == "__main__":
    main()
